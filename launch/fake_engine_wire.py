"""What the fake engine says and checks, apart from HTTP and timing: vLLM's JSON shapes
(pre-encoded for streams), prompt token counts, the P/D leg of a request, the NIXL
``kv_transfer_params`` a prefill instance answers with, and the strict checks of both legs
(PROTOCOLS.md sections 2 and 3).
"""

from __future__ import annotations

import math
import time
from typing import Any

from launch.fake_engine_http import dumps

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PULL_ANSWER_FIELDS = (
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "remote_blocks_expiry_time", "remote_registration_generation",
    "transfer_mode",
)
PUSH_DECODE_FIELDS = (
    "remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "remote_request_id",
)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def leg_of(body: Any) -> str:
    kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if isinstance(kv, dict):
        if kv.get("do_remote_decode"):
            return "prefill"
        if kv.get("do_remote_prefill"):
            return "decode"
    return "plain"


def prompt_chars(path: str, body: dict) -> tuple[int, int]:
    """(chars, prompt_tokens) of a request body."""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
        return chars, max(1, math.ceil(chars / 4))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt), max(1, math.ceil(len(prompt) / 4))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return 4 * len(prompt), len(prompt)
    raise BadRequest("prompt must be a string, a list of one string, or token ids", "prompt")


class Encoder:
    """Pre-encoded pieces of one response; a streamed token costs two concatenations."""

    def __init__(self, rid: str, model: str, chat: bool, max_tokens: int, usage: dict,
                 kv_out: dict | None):
        self.rid, self.model, self.chat, self.max_tokens = rid, model, chat, max_tokens
        self.usage, self.kv_out, self.created = usage, kv_out, int(time.time())
        head = dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": self.created, "model": model})[:-1]
        self.head = b"data: " + head
        if chat:
            self.pre = head.join((b"data: ", b',"choices":[{"index":0,"delta":{"content":"'))
            self.post = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            self.post_last = (b'"},"logprobs":null,"finish_reason":"length","stop_reason":null,'
                              b'"token_ids":null}]}\n\n')
        else:
            self.pre = head.join((b"data: ", b',"choices":[{"index":0,"text":"'))
            self.post = (b'","logprobs":null,"finish_reason":null,"stop_reason":null,'
                         b'"prompt_token_ids":null,"token_ids":null}]}\n\n')
            self.post_last = (b'","logprobs":null,"finish_reason":"length","stop_reason":null,'
                              b'"prompt_token_ids":null,"token_ids":null}]}\n\n')

    def role_chunk(self) -> bytes:
        return self.head + (b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                            b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,'
                            b'"prompt_text":null}\n\n')

    def token_chunk(self, tok: bytes, last: bool) -> bytes:
        if last and self.kv_out is not None:  # a streamed prefill leg: params on the last chunk
            return self.pre + tok + self.post_last[:-4] + b',"kv_transfer_params":' + \
                dumps(self.kv_out) + b"}\n\n"
        return self.pre + tok + (self.post_last if last else self.post)

    def usage_chunk(self) -> bytes:
        return self.head + b',"choices":[],"usage":' + dumps(self.usage) + b"}\n\n"

    def full_body(self, text: bytes) -> bytes:
        u = self.usage
        usage = {"prompt_tokens": u["prompt_tokens"], "total_tokens": u["total_tokens"],
                 "completion_tokens": u["completion_tokens"],
                 "prompt_tokens_details": {**u["prompt_tokens_details"],
                                           "created_cache_tokens": None, "multimodal_tokens": None},
                 "completion_tokens_details": None}
        content = text.decode()
        if self.chat:
            choice = {"index": 0, "message": {
                "role": "assistant", "content": content, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "reasoning": None},
                "logprobs": None, "finish_reason": "length", "stop_reason": None,
                "token_ids": None, "routed_experts": None}
            extra = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                      "prompt_token_ids": None, "routed_experts": None}
            extra = {}
        return dumps({"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                      "created": self.created, "model": self.model, "choices": [choice],
                      "service_tier": None, "system_fingerprint": None, "usage": usage, **extra,
                      "kv_transfer_params": self.kv_out, "ec_transfer_params": None,
                      "metrics": None})


def check_prefill_leg(body: dict, role: str) -> None:
    """Strict: the P leg of pull step 1 / push, exactly."""
    if role == "decode":
        raise BadRequest("this engine is a decode instance: no prefill legs", "kv_transfer_params")
    kv = dict(body["kv_transfer_params"])
    kv.pop("transfer_id", None)  # harmless extra of the newest upstream demo
    if kv != PREFILL_KV_PARAMS:
        raise BadRequest(f"prefill kv_transfer_params must be exactly {PREFILL_KV_PARAMS}, "
                         f"got {body['kv_transfer_params']}", "kv_transfer_params")
    if body.get("stream"):
        raise BadRequest("prefill leg must not stream", "stream")
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        raise BadRequest("prefill leg needs max_tokens=1", "max_tokens")
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and body[key] != 1:
            raise BadRequest(f"prefill leg needs {key}=1, got {body[key]}", key)
    for key in ("min_tokens", "min_completion_tokens"):
        if key in body:
            raise BadRequest(f"prefill leg must not carry {key}", key)


def check_decode_leg(body: dict, role: str, ledger: dict | None) -> None:
    """Strict: a pull D leg carries P's answer (all its fields; verbatim when ``ledger`` holds
    what P issued), a push D leg names P (PUSH_DECODE_FIELDS, non-null)."""
    if role == "prefill":
        raise BadRequest("this engine is a prefill instance: no decode legs", "kv_transfer_params")
    kv = body["kv_transfer_params"]
    if kv.get("do_remote_decode"):
        raise BadRequest("decode leg must have do_remote_decode false",
                         "kv_transfer_params.do_remote_decode")
    if kv.get("remote_block_ids") is not None:  # pull
        for name in PULL_ANSWER_FIELDS:
            if name not in kv:
                raise BadRequest(f"decode kv_transfer_params (pull) lacks {name}",
                                 f"kv_transfer_params.{name}")
        issued = ledger.get(kv["remote_request_id"]) if ledger is not None else None
        if ledger is not None and issued is None:
            raise BadRequest(f"no prefill instance issued {kv['remote_request_id']}",
                             "kv_transfer_params.remote_request_id")
        if issued is not None:
            extra = {k: v for k, v in kv.items() if k not in issued}
            if {k: kv.get(k) for k in issued} != issued or set(extra) - {"prompt_token_ids"}:
                raise BadRequest(f"decode kv_transfer_params differ from P's answer {issued}",
                                 "kv_transfer_params")
        return
    for name in PUSH_DECODE_FIELDS:
        if kv.get(name) is None:
            raise BadRequest(f"decode kv_transfer_params (push) lacks {name}",
                             f"kv_transfer_params.{name}")


def kv_answer(*, internal_id: str, n_prompt: int, first_block: int, engine_id: str,
              kv_host: str, kv_port: int) -> dict:
    """What a NIXL pull prefill instance returns as top-level ``kv_transfer_params``."""
    n_blocks = math.ceil(n_prompt / BLOCK_SIZE)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(range(first_block, first_block + n_blocks))],
            "remote_engine_id": engine_id, "remote_request_id": internal_id,
            "remote_host": kv_host, "remote_port": kv_port, "tp_size": 1, "dcp_size": 1,
            "pp_size": 1, "remote_num_tokens": n_prompt,
            "remote_blocks_expiry_time": time.time() + 30.0,
            "remote_registration_generation": 0, "transfer_mode": "pull"}
