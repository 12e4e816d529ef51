"""``--help`` teaches: every command shows what it does and an example from the guide, and works
without a server or the dev stack."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import run_cli

COMMANDS = [
    ((), "better-compute reserve --tenant acme --pool pool_h100 --gpus 4 --for 8h --nvlink"),
    (("reserve",), "better-compute reserve --tenant acme --pool pool_h100 --gpus 2 --for 8h"),
    (("capacity",), "better-compute capacity --tenant acme --preview --pool pool_h100"),
    (("reservations",), "better-compute reservations get rsv_… --tenant acme --query binding"),
    (("reservations", "get"), "better-compute reservations get rsv_… --tenant acme --query"),
    (("reservations", "list"), "better-compute reservations list --tenant acme"),
    (("extend",), "better-compute extend rsv_… --tenant acme --until +12h"),
    (("renew",), "better-compute renew rsv_… --tenant acme"),
    (("release",), "better-compute release rsv_… --tenant acme"),
    (("cancel",), "better-compute cancel rsv_… --tenant acme"),
    (("dev",), "better-compute dev --sim 4 --port 9090"),
    (("pools",), "better-compute pools --tenant acme"),
]


async def test_every_command_help_has_a_description_and_an_example(tmp_path: Path):
    results = await asyncio.gather(
        *(run_cli(*command, "--help", home=tmp_path) for command, _ in COMMANDS)
    )
    for (command, example), result in zip(COMMANDS, results, strict=True):
        name = " ".join(command) or "better-compute"
        assert result.rc == 0, (name, result)
        assert "Examples:" in result.stdout, name
        assert example in result.stdout, (name, result.stdout)
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (
            ("reserve",),
            ["--for", "--timeout", "--no-wait", "--key", "--binding", "--url", "--output"],
        ),
        (("extend",), ["--until", "--by", "--key", "+12h"]),
        (("reservations", "list"), ["--all", "--state", "--limit", "--cursor"]),
    ],
)
async def test_help_lists_the_options(tmp_path: Path, command: tuple[str, ...], words: list[str]):
    result = await run_cli(*command, "--help", home=tmp_path)
    assert result.rc == 0, result
    for word in words:
        assert word in result.stdout, word


async def test_dev_help_does_not_load_the_dev_stack(tmp_path: Path):
    probe = (
        "import sys\n"
        "sys.argv = ['better-compute', 'dev', '--help']\n"
        "from bettercompute.cli.app import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('bettercompute.dev',"
        " 'bettercompute.store', 'bettercompute.service', 'bettercompute.api')))\n"
        "print('LOADED', loaded, file=sys.stderr)\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        probe,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert "--state-dir" in out.decode()
    assert "LOADED []" in err.decode()


async def test_no_command_shows_the_overview(tmp_path: Path):
    result = await run_cli(home=tmp_path)
    assert "reserve" in result.stdout + result.stderr
    assert "reservations" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


async def test_version_short_help_and_completion(tmp_path: Path):
    version = await run_cli("--version", home=tmp_path)
    assert version.rc == 0, version
    assert version.stdout.startswith("better-compute ")
    short = await run_cli("reserve", "-h", home=tmp_path)
    assert short.rc == 0, short
    assert "--gpus" in short.stdout
    # What bash asks once completion is installed: the commands that start with "res".
    completion = await run_cli(
        home=tmp_path,
        env={
            "_BETTER_COMPUTE_COMPLETE": "complete_bash",
            "COMP_WORDS": "better-compute res",
            "COMP_CWORD": "1",
        },
    )
    assert completion.stdout.split() == ["reserve", "reservations"], completion
