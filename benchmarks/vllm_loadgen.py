"""``benchmarks.loadgen`` for real vLLM servers: tokens counted from the usage chunk.

loadgen counts one token per SSE event. A real vLLM API server that falls behind its engine
(a busy CPU host) merges several tokens into one streamed chunk (``RequestOutputCollector``
aggregates DELTA outputs), so a complete 32-token answer can arrive as 28 events and loadgen
would call it a short stream (an error) and leave it out of the latency statistics. This
wrapper keeps everything else of loadgen (client, open/closed loop, summary, JSON) and only
replaces the count: when the stream's final usage chunk (``stream_options.include_usage``,
which loadgen always asks for) reports ``completion_tokens``, that is the request's token
count. TTFT is unchanged; ITL stays the gap between streamed chunks as a client sees them.

    python -m benchmarks.vllm_loadgen --url http://127.0.0.1:8000 --rate 1 --duration 10 ...
"""

from __future__ import annotations

import re

from benchmarks import loadgen

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


class UsageCountingConn(loadgen._Conn):
    def _event(self, ev: bytes, now: float) -> None:
        usage = _COMPLETION_TOKENS.search(ev)
        if usage is None:
            super()._event(ev, now)
            return
        self.res.usage_tokens = int(usage.group(1))  # type: ignore[attr-defined]
        if (b'"text"' in ev or b'"content"' in ev) and b'"role"' not in ev:
            super()._event(ev, now)  # a usage-carrying token event still counts as a token

    def _finish(self, error: str | None) -> None:
        res = self.res
        if res is not None and getattr(res, "usage_tokens", None) is not None:
            res.tokens = res.usage_tokens
        super()._finish(error)


def main(argv: list[str] | None = None) -> None:
    loadgen.LoadGen.conn_class = UsageCountingConn
    loadgen.main(argv)


if __name__ == "__main__":
    main()
