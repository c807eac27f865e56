"""Logging setup: text or JSON lines, one level for all pd_router loggers.

Lines are written in batches (`BatchedStreamHandler`): the access log writes a line per
request, and one write syscall per line was a measurable part of the router's CPU per request
(docs/performance.md). Records at WARNING and above are written at once, with whatever is
pending before them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import orjson


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.name == "pd_router.access" and msg.startswith("{"):  # already a JSON object: stamp it
            return f'{{"ts":{round(record.created, 3)},"level":"{record.levelname.lower()}",' + msg[1:]
        doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name, "msg": msg}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


class TextFormatter(logging.Formatter):
    """logging.Formatter with UTC times, formatted once per second: the same text as
    `formatTime`'s (`2026-11-30 01:02:03,456`), without a `strftime` for every access-log line."""

    converter = time.gmtime

    def __init__(self, fmt: str | None = None) -> None:
        super().__init__(fmt)
        self._stamp: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt:
            return super().formatTime(record, datefmt)
        sec = int(record.created)
        stamp = self._stamp
        if stamp[0] != sec:
            stamp = self._stamp = (sec, time.strftime(self.default_time_format, self.converter(sec)))
        return self.default_msec_format % (stamp[1], record.msecs)


class BatchedStreamHandler(logging.StreamHandler):
    """A StreamHandler that collects lines and writes them every `interval` seconds (from the
    event loop of the thread that logged the first pending line), at WARNING and above, when
    `max_pending` lines wait, and at exit. Outside an event loop it writes at once."""

    def __init__(self, stream=None, *, interval: float = 0.05, max_pending: int = 256):
        super().__init__(stream)
        self.interval = interval
        self.max_pending = max_pending
        self._pending: list[str] = []
        self._scheduled = None  # the loop a flush is scheduled on

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - as logging.StreamHandler: report, never raise
            self.handleError(record)
            return
        now = record.levelno >= logging.WARNING
        with self.lock:
            self._pending.append(line)
            if not now and len(self._pending) < self.max_pending:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is not None:
                    if self._scheduled is not loop:  # none yet (or one on a loop since gone)
                        self._scheduled = loop
                        loop.call_later(self.interval, self.flush)
                    return
        self.flush()

    def flush(self) -> None:
        with self.lock:
            self._scheduled = None
            if not self._pending:
                return
            text = "".join(self._pending)
            self._pending.clear()
            try:
                self.stream.write(text)
                if hasattr(self.stream, "flush"):
                    self.stream.flush()
            except Exception:  # noqa: BLE001 - a closed stderr must not break a request
                pass


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    # LogRecords need no pid, thread or caller lookups: no format uses them (the logging
    # HOWTO's "Optimization" section lists these switches).
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    logging._srcfile = None
    handler = BatchedStreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
