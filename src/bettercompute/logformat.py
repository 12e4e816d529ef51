"""How the long-running programs (the operator, the node agent, ``dev``) write their logs.

Why a module of its own: both take ``--log-format text|json``; JSON lines (one object per
record: ``time``, ``level``, ``logger``, ``message``, and kopf's object fields where it adds
them) are what log pipelines (Loki, Elasticsearch, Cloud Logging) parse without rules. The JSON
comes from python-json-logger, the maintained formatter for the standard library's logging.
Either way a record's time is RFC 3339 in UTC, as every time people read.

What it must never do: print anything itself, or drop a record's level or message.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(*, level: str = "INFO", log_format: str = "text") -> None:
    """Send every record of the process to stderr in ``log_format``; ``ValueError`` names a
    format that is neither. Like ``logging.basicConfig``, it leaves logging alone where it is
    configured already (a program run in-process by a test runner)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: must be one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    root.addHandler(handler)
    root.setLevel(level.upper())


def rfc3339(record: logging.LogRecord) -> str:
    """When ``record`` was made, as every time people read is shown: RFC 3339 in UTC, to the
    millisecond (``2026-12-24T08:00:00.123Z``), never the machine's local time."""
    moment = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{moment}.{int(record.msecs):03d}Z"


class _Text(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return rfc3339(record)


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        class _Json(JsonFormatter):
            def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
                return rfc3339(record)

        return _Json(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    return _Text(TEXT)
