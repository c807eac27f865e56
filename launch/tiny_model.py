"""A tiny random-weight Llama built locally, so real vLLM can run with no hub access.

What it is (see docs/VLLM_CPU.md in the shared docs):
- ``LlamaForCausalLM``: 2 layers, hidden 256, intermediate 512, 4 heads (4 KV heads),
  vocab 4096, float32, ``max_position_embeddings`` 2048, weights drawn with a fixed seed.
  About 3.4 M parameters, 14 MB.
- A byte-level BPE tokenizer (vocab 4096) trained with ``tokenizers`` on the ``*.py`` files at
  the top of this Python's stdlib directory (sorted list, fixed trainer settings), saved as a
  ``PreTrainedTokenizerFast`` with a ChatML chat template.
- Special tokens: id 0 ``<|endoftext|>`` (bos and pad), id 1 ``<|im_start|>``, id 2
  ``<|im_end|>`` (eos; the chat template ends each turn with it). No token is added
  automatically when text is encoded (no post-processor), so vLLM's and transformers'
  ``encode(text)`` give the same ids.
- Serve it with ``--max-model-len 2048`` (the position limit) or less; launch defaults to 2048
  because the KV cache for it is small (4 KiB per token) and it lets benchmarks send prompts
  well above a P/D threshold.

Builds are deterministic: on the same Python and library versions a rebuild is byte-identical.
The stdlib sources differ between Python patch releases, so another Python may give another
tokenizer; the cache is keyed by ``VERSION`` only, so a machine keeps whichever it built first.

Cache: ``$PD_ROUTER_CACHE`` or ``~/.cache/pd-router``, subdirectory ``tiny-llama-v<VERSION>``.
The model is written to a temporary directory next to the destination and renamed into place,
so concurrent builders (pytest-xdist workers, parallel CI jobs) never see a half-written model:
the first rename wins and the others discard their copy.

CLI: ``python -m launch.tiny_model [DIR]`` builds (or finds) the model and prints its path.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

VERSION = 1
SEED = 1234
VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
SERVED_NAME = "tiny-llama"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN = PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Files whose presence marks a complete model directory.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    """The pd-router cache directory (``$PD_ROUTER_CACHE`` or ``~/.cache/pd-router``)."""
    env = os.environ.get("PD_ROUTER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pd-router"


def default_path() -> Path:
    return cache_root() / f"tiny-llama-v{VERSION}"


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def ensure_tiny_model(dest: Path | None = None) -> Path:
    """Return the tiny model directory, building it first if it is missing."""
    dest = Path(dest) if dest is not None else default_path()
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the model is not a secret
        try:
            os.rename(tmp, dest)
        except OSError:
            # Another builder won the race (dest exists and is not empty) -- keep theirs.
            if not is_complete(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def training_files() -> list[str]:
    """The tokenizer's training corpus: the stdlib's top-level ``*.py`` files, sorted."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in stdlib.glob("*.py") if p.is_file())


def build_tokenizer():
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(training_files(), trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer):
    """Random-weight ``LlamaForCausalLM`` (fixed seed, float32)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    return model


def build(out: Path) -> Path:
    """Build the model and tokenizer into ``out`` (no caching, no atomicity)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m launch.tiny_model [DIR]", file=sys.stderr)
        return 2
    print(ensure_tiny_model(Path(argv[0]) if argv else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
