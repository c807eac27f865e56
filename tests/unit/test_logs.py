"""router/logs.py: batched log lines (one write per batch, not per access-log line)."""

from __future__ import annotations

import asyncio
import io
import logging

from router.logs import BatchedStreamHandler


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def _logger(stream, **kw) -> tuple[logging.Logger, BatchedStreamHandler]:
    log = logging.getLogger(f"test.batched.{id(stream)}")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = BatchedStreamHandler(stream, **kw)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    return log, handler


async def test_lines_in_a_loop_are_written_together_after_the_interval():
    stream = CountingStream()
    log, _ = _logger(stream, interval=0.05)
    for i in range(100):
        log.info("request %d", i)
    assert stream.writes == 0
    await asyncio.sleep(0.2)
    assert stream.writes == 1 and stream.getvalue().count("\n") == 100
    assert stream.getvalue().splitlines()[0] == "INFO request 0"


async def test_a_warning_writes_at_once_with_what_was_pending_and_max_pending_bounds_the_batch():
    stream = CountingStream()
    log, _ = _logger(stream, interval=10, max_pending=50)
    log.info("first")
    log.warning("trouble")
    assert stream.getvalue() == "INFO first\nWARNING trouble\n"
    for i in range(50):
        log.info("x %d", i)
    assert stream.getvalue().count("\n") == 52  # the 50th pending line forced the write


def test_outside_an_event_loop_lines_are_written_at_once_and_close_flushes():
    stream = CountingStream()
    log, handler = _logger(stream)
    log.info("now")
    assert stream.getvalue() == "INFO now\n"

    async def burst() -> None:
        log.info("pending at exit")

    asyncio.run(burst())  # the loop is gone before its flush timer fired
    handler.flush()  # what logging.shutdown does at exit
    assert stream.getvalue().endswith("INFO pending at exit\n")
    log.info("after")  # a later line outside any loop is not stuck behind the dead loop's timer
    assert stream.getvalue().endswith("INFO after\n")


def test_text_formatter_times_equal_the_stock_formatter_in_utc():
    """TextFormatter formats the date once per second; every line must read as the stock
    Formatter's with time.gmtime would (seconds that change, milliseconds, the same second twice)."""
    import time

    from router.logs import TextFormatter

    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    ours = TextFormatter(fmt)
    stock = logging.Formatter(fmt)
    stock.converter = time.gmtime
    for t in (0.0, 0.5, 1.999, 1700000000.0005, 1700000000.9995, 1700000001.25, 1700000001.75, 1700003600.0,
              1.0):
        rec = logging.LogRecord("pd_router.access", logging.INFO, "", 0, "request_id=x", None, None)
        rec.created, rec.msecs = t, int((t - int(t)) * 1000) + 0.0
        assert ours.format(rec) == stock.format(rec)
