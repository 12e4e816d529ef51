"""``--log-format``: text lines, or one JSON object per record with time, level, logger and
message (and what the caller added), for both long-running programs."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bettercompute import logformat


@pytest.fixture(autouse=True)
def _restore_logging():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def fresh() -> None:
    """As in a new process: no handler yet (pytest's own are put back afterwards)."""
    logging.getLogger().handlers[:] = []


def test_json_lines_carry_time_level_logger_message_and_extras(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fresh()
    logformat.configure(level="info", log_format="json")
    logging.getLogger("bettercompute.test").warning(
        "bound %s", "alloc_1", extra={"node": "gpu-node-1"}
    )
    logging.getLogger("bettercompute.test").debug("not shown at info")
    [line] = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["level"] == "WARNING"
    assert record["logger"] == "bettercompute.test"
    assert record["message"] == "bound alloc_1"
    assert record["node"] == "gpu-node-1"
    assert record["time"].startswith("20")


def test_text_is_the_default_and_an_unknown_format_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fresh()
    logformat.configure()
    logging.getLogger("x").info("hello")
    assert capsys.readouterr().err.rstrip().endswith("INFO x: hello")
    with pytest.raises(ValueError, match="must be one of text, json"):
        logformat.configure(log_format="yaml")


def test_logging_configured_already_is_left_alone() -> None:
    fresh()
    mine = logging.NullHandler()
    logging.getLogger().addHandler(mine)
    logformat.configure(log_format="json")
    assert logging.getLogger().handlers == [mine]


@pytest.mark.parametrize(
    "program",
    [["better-compute-operator"], ["better-compute-deviceplugin", "--node-name", "n1"]],
)
def test_both_programs_refuse_an_unknown_format_naming_the_flag(program: list[str]) -> None:
    script = Path(sys.executable).parent / program[0]  # the installed console script
    done = subprocess.run(
        [str(script), *program[1:], "--log-format", "yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        # Never reached: the format is checked first.
        env={**os.environ, "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"},
    )
    assert done.returncode == 2, done
    assert "--log-format" in done.stderr


RFC3339_MS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_both_formats_stamp_records_in_rfc_3339_utc(capsys: pytest.CaptureFixture[str]) -> None:
    fresh()
    logformat.configure(log_format="json")
    logging.getLogger("x").warning("hello")
    record = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert re.fullmatch(RFC3339_MS, record["time"]), record
    fresh()
    logformat.configure()
    logging.getLogger("x").warning("hello")
    line = capsys.readouterr().err.splitlines()[-1]
    assert re.match(rf"{RFC3339_MS} WARNING x: hello$", line), line
