"""Structured logs of the in-cluster commands (runner, wait-for): one line per record.

`event(logger, action, **fields)` writes `{"ts", "level", "logger", "action", ...fields}` so a
log pipeline can filter on `action` (e.g. `apply`, `wait-lease`, `invalid-spec`): as a JSON
object (`--log-format json`, the default) or as `ts level logger action key=value ...` (`text`).
Both commands take `--log-level` and `--log-format`, defaulting to $LOG_LEVEL and $LOG_FORMAT,
which the chart sets from the `log` values of the runner and of each component.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

LEVELS = ("debug", "info", "warn", "error")
FORMATS = ("json", "text")


def _record(record: logging.LogRecord, formatter: logging.Formatter) -> dict:
    """The fields of one line: ts, level, logger, then the event's fields (or `msg`)."""
    line = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
    }
    line.update(getattr(record, "fields", None) or {"msg": record.getMessage()})
    if record.exc_info:
        line["error"] = formatter.formatException(record.exc_info)
    return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_record(record, self), default=str, sort_keys=False)


class TextFormatter(logging.Formatter):
    """`ts level logger action key=value ...`; a value that is not a plain word is JSON-quoted."""

    def format(self, record: logging.LogRecord) -> str:
        line = _record(record, self)
        head = [line.pop("ts"), line.pop("level"), line.pop("logger"), str(line.pop("action", ""))]
        return " ".join([*filter(None, head), *(f"{key}={_word(value)}" for key, value in line.items())])


def _word(value) -> str:
    plain = isinstance(value, str) and value and not any(c.isspace() or c in '"=' for c in value)
    return value if plain else json.dumps(value, default=str)


def _choice(name: str, allowed: tuple[str, ...]):
    """An argparse type that also checks a default taken from the environment."""

    def parse(text: str) -> str:
        if text.lower() not in allowed:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not one of {', '.join(allowed)} (from --{name} or ${name.upper().replace('-', '_')})"
            )
        return text.lower()

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, defaulting to $LOG_LEVEL and $LOG_FORMAT."""
    parser.add_argument(
        "--log-level",
        type=_choice("log-level", LEVELS),
        default=os.environ.get("LOG_LEVEL") or "info",
        help=f"{', '.join(LEVELS)} (default: $LOG_LEVEL, else info)",
    )
    parser.add_argument(
        "--log-format",
        type=_choice("log-format", FORMATS),
        default=os.environ.get("LOG_FORMAT") or "json",
        help=f"{' or '.join(FORMATS)} (default: $LOG_FORMAT, else json)",
    )


def setup(level: str = "info", log_format: str = "json") -> None:
    """Send every log record to stderr, one line each (called once by each command)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if log_format == "text" else JsonFormatter())
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
