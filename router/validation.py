"""Request checks the router can make itself, before any engine sees the request.

Each failure is a BadRequest naming the parameter, as OpenAI and vLLM do.
"""

from __future__ import annotations

import re

from router.errors import BadRequest

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# Address markers MoRIIO / P2P-NCCL routing reads out of request ids (PROTOCOLS.md 4, 5).
FORBIDDEN_ID_MARKERS = ("___prefill_addr_", "___decode_addr_", "___")


def check_request_id(value: str) -> str:
    if not REQUEST_ID_RE.match(value) or any(m in value for m in FORBIDDEN_ID_MARKERS):
        raise BadRequest("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-] and contain no '___' "
                         "address markers", param="X-Request-Id", code="invalid_request_id")
    return value


def _int_param(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer", param=name)
    if v < low:
        raise BadRequest(f"{name} must be at least {low}, got {v}", param=name)
    if v > high:
        raise BadRequest(f"{name} must be at most {high}, got {v}", param=name)
    return v


def check_body(kind: str, body: dict, *, max_tokens_limit: int, max_n: int) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    for name in ("max_tokens", "max_completion_tokens"):
        _int_param(body, name, 1, max_tokens_limit)
    _int_param(body, "n", 1, max_n)
    _int_param(body, "min_tokens", 0, max_tokens_limit)
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params is set by the router, not by clients", param="kv_transfer_params")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty array", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string role", param="messages")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise BadRequest(f"messages[{i}].content must be a string or an array of parts", param="messages")
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            return
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return
            if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p):
                return
            if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)
                   for x in p):
                return
        raise BadRequest("prompt must be a string, an array of strings, or an array (of arrays) of token ids",
                         param="prompt")


def is_batch(kind: str, body: dict) -> bool:
    if kind != "completions":
        return False
    p = body.get("prompt")
    return isinstance(p, list) and len(p) > 1 and not isinstance(p[0], int)


def check_context(prompt_tokens: int, body: dict, max_model_len: int | None) -> None:
    if not max_model_len:
        return
    want = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    if prompt_tokens + want > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + want} tokens ({prompt_tokens} in the prompt, {want} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="prompt" if want < max_model_len else "max_tokens", code="context_length_exceeded")
