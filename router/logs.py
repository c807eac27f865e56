"""Logging setup: text or JSON lines, one level for all pd_router loggers."""

from __future__ import annotations

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


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        f = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        f.converter = time.gmtime
        handler.setFormatter(f)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
