"""Every process's log setup: one format flag (`--log-format text|json`), the same line shapes
in the coordinator and the workers, and the request id (common/request_id.py) on each line
written while a request is served, so `grep REQUEST_ID *.log` ties one request's lines together.

    text:  2026-12-01 23:57:18,123 INFO coordinator.access: ... [request_id=R]
    json:  {"ts": "2026-12-01T23:57:18.123Z", "level": "INFO", "logger": "...", "msg": "...",
            "request_id": "R"}                   one object per line; request_id only when known

Torch-free; the entry points call setup_logging once.
"""

from __future__ import annotations

import json
import logging
import time

from common import request_id

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` from the context of the code that logs ("" when none). A filter
    on the handler, so records of every logger (uvicorn's, grpc's) get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id.current.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", "")
        if not rid:
            return line
        # The id goes after the message's first line, so a traceback stays below it.
        first, sep, rest = line.partition("\n")
        return f"{first} [request_id={rid}]{sep}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback is the `exc` field, never extra lines."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
                "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", "")
        if rid:
            line["request_id"] = rid
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(level: str, log_format: str = "text") -> None:
    """The root logger writes to stderr in `log_format` at `level` (a logging level name);
    replaces any handler set before. ValueError names a bad value."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)


def add_log_flags(parser) -> None:
    """--log-level and --log-format, the same in every process."""
    parser.add_argument("--log-level", default="info",
                        help="debug, info, warning or error (default info)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text lines, or one JSON object per line (ts, level, logger, msg, "
                             "request_id when known) for log collectors (default text)")
