"""One exception hierarchy for the router, turned into OpenAI-shaped bodies once.

    RouterError                      status  type
    ├── BadRequest                    400    invalid_request_error
    │   ├── ModelNotFound             404    not_found_error (code model_not_found)
    │   └── PayloadTooLarge           413    invalid_request_error
    ├── Unauthorized                  401    authentication_error
    ├── Overloaded                    429    rate_limit_error (Retry-After)
    ├── NoInstance                    503    service_unavailable
    ├── TokenizerUnavailable          503    service_unavailable (code tokenizer_unavailable)
    └── UpstreamError                 502    upstream_error (stage: prefill|decode)
        ├── UpstreamTimeout           504    timeout
        └── UpstreamStatus            the engine's status, the engine's body

Lower-level errors (httpx, JSON decoding) are translated where they happen, in
`upstream.py` and `api.py`; handlers only ever raise these.
"""

from __future__ import annotations

import orjson


class RouterError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None
    counted = False  # set once pd_router_errors_total has counted this error (dispatch or api)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    @property
    def kind(self) -> str:
        """A bounded label for metrics."""
        return self.code or self.type

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.body())


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class ModelNotFound(BadRequest):
    status = 404
    type = "not_found_error"
    code = "model_not_found"


class PayloadTooLarge(BadRequest):
    status = 413
    code = "payload_too_large"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Overloaded(RouterError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class NoInstance(RouterError):
    status = 503
    type = "service_unavailable"
    code = "no_instance"


class TokenizerUnavailable(RouterError):
    """The router cannot count prompt tokens: its tokenizer failed to load (retried on the next
    request that needs it)."""
    status = 503
    type = "service_unavailable"
    code = "tokenizer_unavailable"


class UpstreamError(RouterError):
    """An engine failed. `stage` says which leg: prefill or decode."""

    status = 502
    type = "upstream_error"

    def __init__(self, message: str, *, stage: str, code: str | None = None):
        super().__init__(message, code=code)
        self.stage = stage


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"


class UpstreamStatus(UpstreamError):
    """The engine answered with an error status; its body is passed through."""

    def __init__(self, status: int, body: bytes, *, stage: str):
        message, etype, code = _describe(body, status)
        super().__init__(message, stage=stage, code=code)
        # 4xx from an engine is the client's fault and keeps its status; a 5xx
        # becomes 502 so clients can tell "the router's backend broke".
        self.status = status if 400 <= status < 500 else 502
        self.type = etype if 400 <= status < 500 else "upstream_error"
        self.engine_status = status
        self.raw = body

    @property
    def kind(self) -> str:
        return f"http_{self.engine_status}"


def error_body(message: str, etype: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def sse_error_event(err: RouterError) -> bytes:
    """The event a stream ends with when it fails after the first byte."""
    return b"data: " + err.to_bytes() + b"\n\ndata: [DONE]\n\n"


def _describe(body: bytes, status: int) -> tuple[str, str, str | None]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        code = err.get("code")
        return err["message"], str(err.get("type") or "upstream_error"), code if isinstance(code, str) else None
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):  # vLLM's older shape
        return doc["message"], str(doc.get("type") or "upstream_error"), None
    text = body[:200].decode("utf-8", "replace").strip()
    return f"engine answered HTTP {status}" + (f": {text}" if text else ""), "upstream_error", None
