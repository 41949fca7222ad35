"""common/request_id.py and common/log_format.py: which ids pass, and the two line shapes."""

from __future__ import annotations

import json
import logging

import pytest

from common import request_id
from common.log_format import JsonFormatter, RequestIdFilter, TextFormatter, setup_logging


@pytest.mark.parametrize("value, ok", [
    ("abc-123", True), ("x" * request_id.MAX_LENGTH, True),
    ("x" * (request_id.MAX_LENGTH + 1), False), ("", False), (None, False),
    ("has space", False), ("line\nbreak", False), ("caf\u00e9", False), ("tab\t", False),
])
def test_which_ids_are_taken(value, ok):
    assert request_id.valid(value) == (value if ok else None)
    made = request_id.accept(value)
    assert made == value if ok else (len(made) == 32 and made != value)


def test_metadata_round_trip_refuses_bad_values():
    assert request_id.from_metadata(request_id.metadata("r-1")) == "r-1"
    assert request_id.from_metadata([("x-request-id", b"r-2")]) == "r-2"
    assert request_id.from_metadata([("x-request-id", "bad id")]) == ""
    assert request_id.from_metadata(None) == "" and request_id.metadata("") == ()


def _record(msg: str, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys
            exc_info = sys.exc_info()
    record = logging.LogRecord("tandem.test", logging.WARNING, __file__, 1, msg, (), exc_info)
    RequestIdFilter().filter(record)
    return record


def test_lines_carry_the_request_id_of_the_context():
    with request_id.serving("req-7"):
        inside = _record("hello \"quoted\"")
    outside = _record("no request")
    assert request_id.current.get() == ""  # restored
    line = json.loads(JsonFormatter().format(inside))
    assert line["request_id"] == "req-7" and line["msg"] == 'hello "quoted"'
    assert line["level"] == "WARNING" and line["logger"] == "tandem.test"
    assert line["ts"].endswith("Z") and "T" in line["ts"]
    assert "request_id" not in json.loads(JsonFormatter().format(outside))
    assert TextFormatter().format(inside).endswith("hello \"quoted\" [request_id=req-7]")
    assert "request_id" not in TextFormatter().format(outside)


def test_a_traceback_stays_inside_its_json_line():
    text = JsonFormatter().format(_record("failed", exc=True))
    assert "\n" not in text
    assert "ValueError: boom" in json.loads(text)["exc"]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        setup_logging("info", "xml")
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        setup_logging("loud")
