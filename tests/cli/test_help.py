"""``--help`` teaches: every command shows what it does and an example from the guide, and works
without a server or the dev stack."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer

from bettercompute.cli import app as cli_app
from bettercompute.kubectl import app as kubectl_app
from tests.cli.conftest import Cli, Server, run_cli

#: The pools of the demo world (src/bettercompute/dev/demo.yaml) that examples may name.
DEMO_POOLS = ("pool_h100", "pool_a100_mig")

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


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command of a program, as the words that name it (the program itself is ``()``).
    Typer's commands are its own click's: they are read by their attributes."""
    found = [path]
    for name, command in sorted((getattr(group, "commands", None) or {}).items()):
        found += _commands(command, (*path, name))
    return found


def _options(group: Any) -> dict[str, set[tuple[str, str]]]:
    """Each visible option's declared defaults, with the command that declares each."""
    seen: dict[str, set[tuple[str, str]]] = {}
    for path in _commands(group):
        command = group
        for word in path:
            command = command.commands[word]
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                seen.setdefault(param.opts[0], set()).add((repr(param.default), " ".join(path)))
    return seen


PROGRAMS = {
    "better-compute": ("bettercompute.cli.app", cli_app.app),
    "kubectl bcd": ("bettercompute.kubectl.app", kubectl_app.app),
}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
async def test_every_help_reads_right(tmp_path: Path, program: str):
    """No ``<bool>`` placeholder on a switch, no ``--no-no-…`` option, examples that name the
    demo's real pools (never the guide's ``pool_01k…``), in every command's rich help."""
    module, typer_app = PROGRAMS[program]
    commands = _commands(typer.main.get_command(typer_app))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BETTER_COMPUTE_")}
    env.update({"HOME": str(tmp_path), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "xterm"})

    async def show(path: tuple[str, ...]) -> tuple[int | None, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *path, "--help",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 60)
        return process.returncode, out.decode(), err.decode()

    shown = await asyncio.gather(*(show(path) for path in commands))
    assert len(commands) > 5
    for path, (rc, out, err) in zip(commands, shown, strict=True):
        name = " ".join((program, *path))
        assert rc == 0, (name, err)
        assert "Usage:" in out, name
        assert "<bool>" not in out, (name, out)
        assert "BOOLEAN" not in out, (name, out)
        assert "--no-no-" not in out, (name, out)
        assert "pool_01k" not in out, (name, out)
        for pool in re.findall(r"--pool (pool_\w+)", out):
            assert pool in DEMO_POOLS, (name, pool)


def test_an_option_has_one_default_wherever_it_appears():
    """The same flag means the same default in every command of a program (and the two
    programs' shared flags are in docs/cli.md); the exceptions say why."""
    # --limit: capacity --find's windows (5) against a list page (the server's 50).
    # --for: reserve's length (required) against watch's stop-after (until Ctrl-C) and find's
    # window (1h); --state: each list filters its own states; --timeout: extend/renew/release
    # wait for one answer (1m), reserve for Ready (5m); --url: subscriptions create's webhook.
    differ = {"--limit", "--for", "--state", "--timeout", "--url"}
    for program, (_, typer_app) in PROGRAMS.items():
        for option, defaults in _options(typer.main.get_command(typer_app)).items():
            if option not in differ:
                assert len({default for default, _ in defaults}) == 1, (program, option, defaults)


def test_the_demo_pools_the_examples_name_exist():
    demo = Path(__file__).resolve().parents[2] / "src/bettercompute/dev/demo.yaml"
    text = demo.read_text()
    for pool in DEMO_POOLS:
        assert f"id: {pool}\n" in text, pool


async def test_version_names_the_servers_when_it_answers(cli: Cli, server: Server, tmp_path: Path):
    installed = metadata.version("better-compute")
    both = await cli("--version")
    assert both.rc == 0, both
    # The server's version is its OpenAPI document's info.version, which needs no token.
    async with httpx.AsyncClient() as http:
        document = (await http.get(f"{server.url}/api/compute/openapi.json")).json()
    assert both.stdout == (
        f"better-compute {installed}\nserver {document['info']['version']} ({server.url})\n"
    )
    alone = await run_cli(
        "--version", home=tmp_path, env={"BETTER_COMPUTE_URL": "http://127.0.0.1:9"}
    )
    assert alone.rc == 0, alone
    assert alone.stdout == f"better-compute {installed}\n"
    assert alone.stderr.startswith("(no server version: cannot reach"), alone
