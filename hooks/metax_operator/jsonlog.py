"""Structured logs of the in-cluster commands (runner, wait-for): one JSON object per line.

`event(logger, action, **fields)` writes `{"ts", "level", "logger", "action", ...fields}` so a
log pipeline can filter on `action` (e.g. `apply`, `wait-lease`, `invalid-spec`).
"""
from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        line.update(getattr(record, "fields", None) or {"msg": record.getMessage()})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, sort_keys=False)


def setup(level: str = "info") -> None:
    """Send every log record to stderr as JSON lines (called once by each command)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The kubernetes client's leader election logs every retry at info; we log transitions ourselves.
    logging.getLogger("leaderelection").setLevel(logging.WARNING)
    # Its REST layer logs every response body at debug.
    logging.getLogger("kubernetes.client.rest").setLevel(logging.INFO)


def event(logger: logging.Logger, action: str, level: int = logging.INFO, **fields) -> None:
    """Log one action as one line: `action` plus its fields."""
    logger.log(level, action, extra={"fields": {"action": action, **fields}})
