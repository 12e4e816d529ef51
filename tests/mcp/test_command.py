"""``better-compute mcp`` as an MCP client starts it: a subprocess on stdin/stdout, found through
the same settings as every command (environment, config file), and without its extra a one-line
message instead of a traceback."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from mcp import Client, StdioServerParameters
from tests.cli.conftest import run_cli
from tests.mcp.conftest import ALICE, Server, called
from tests.mcp.test_tools import TOOLS

COMMAND = [sys.executable, "-m", "bettercompute.cli.app", "mcp"]


def stdio(home: Path, **env: str) -> StdioServerParameters:
    """The command an MCP client's config names, with only ``env`` (and HOME) given."""
    return StdioServerParameters(
        command=COMMAND[0], args=COMMAND[1:], env={"HOME": str(home), **env}, cwd=str(home)
    )


async def test_an_mcp_client_starts_it_over_stdio_and_lists_the_tools(
    server: Server, tmp_path: Path
):
    params = stdio(tmp_path, BETTER_COMPUTE_URL=server.url, BETTER_COMPUTE_TOKEN=ALICE)
    async with Client(params, mode="legacy") as client:  # the initialize handshake
        assert client.server_info is not None
        assert client.server_info.name == "better-compute"
        listed = await client.list_tools()
        made = called(
            await client.call_tool("reserve_gpus", {"pool": "pool_a", "count": 1, "duration": "1h"})
        )
    assert {tool.name for tool in listed.tools} == TOOLS
    assert made["outcome"] == "created"
    # As alice, for her tenant (asked of the server: none was given).
    stored = await server.call(
        "reservations/get", {"tenantId": "acme", "reservationId": made["reservation"]["id"]}
    )
    assert stored["ownerIdentityId"] == "alice"


async def test_it_reads_the_config_file_like_every_command(server: Server, tmp_path: Path):
    config = tmp_path / ".config" / "better-compute" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(f"url: {server.url}\ntoken: {ALICE}\ntenant: acme\n", encoding="utf-8")
    async with Client(stdio(tmp_path)) as client:
        listed = called(await client.call_tool("list_reservations", {"scope": "all"}))
    assert listed["items"] == []


async def test_help_describes_it_without_loading_the_sdk(tmp_path: Path):
    helped = await run_cli("mcp", "--help", home=tmp_path)
    assert helped.rc == 0, helped
    assert "MCP tools" in helped.stdout
    assert "Examples:" in helped.stdout
    assert "better-compute mcp" in helped.stdout
    for option in ("--url", "--token", "--tenant"):
        assert option in helped.stdout
    listed = await run_cli("--help", home=tmp_path)
    assert " mcp " in listed.stdout, listed

    probe = (
        "import sys\n"
        "sys.argv = ['better-compute', 'mcp', '--help']\n"
        "from bettercompute.cli.app import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "loaded = sorted(m for m in sys.modules if m == 'mcp' or m.startswith("
        "('mcp.', 'bettercompute.mcp')))\n"
        "print('LOADED', loaded, file=sys.stderr)\n"
    )
    err = await _python(probe, tmp_path)
    assert "LOADED []" in err


async def test_without_the_extra_it_says_which_to_install(tmp_path: Path):
    probe = (
        "import sys\n"
        "class NoMcp:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mcp' or name.startswith('mcp.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoMcp())\n"
        "sys.argv = ['better-compute', 'mcp']\n"
        "from bettercompute.cli.app import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e.code, file=sys.stderr)\n"
    )
    err = await _python(probe, tmp_path)
    assert (
        "better-compute mcp needs the 'mcp' extra: pip install 'better-compute[mcp]'"
        " (no module named 'mcp')"
    ) in err
    assert "EXIT 1" in err
    assert "Traceback" not in err


async def _python(code: str, home: Path) -> str:
    """Run ``code`` in a fresh interpreter; its stderr, after checking it exited."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200", "NO_COLOR": "1"},
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return err.decode()
