"""``better-compute mcp`` against a live server: the CLI tests' real API on a real socket over the
test PostgreSQL (the ``server`` fixture, reused), the CLI's own ``ApiClient`` as the tools'
client, and the MCP SDK's in-process ``Client`` calling the tools as an agent would.

The client is opened inside each test (``tools(...)``), not in a fixture: the SDK's task groups
must be entered and left by the same task.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from mcp.types import CallToolResult, TextContent

from bettercompute.cli.client import ApiClient, Failure
from bettercompute.mcp import server as mcp_server
from mcp import Client
from tests.cli.conftest import ALICE, Server, server

__all__ = ["ALICE", "Server", "called", "error_text", "server", "tools"]


@asynccontextmanager
async def tools(
    url: str, *, token: str | None = ALICE, tenant: str | None = None
) -> AsyncIterator[Client]:
    """An MCP client session with the tools, which call ``url`` with ``token``."""
    with ApiClient(url=url, token=token, timeout_s=45.0) as api:
        door = mcp_server.build(api, refusal=Failure, tenant=tenant)
        async with Client(door) as client:
            yield client


def called(result: CallToolResult) -> dict[str, Any]:
    """A successful call's answer: its structured content, which the text repeats as JSON."""
    assert not result.is_error, error_text(result)
    assert result.structured_content is not None
    text = result.content[0]
    assert isinstance(text, TextContent)
    assert json.loads(text.text) == result.structured_content
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    """A call's text, as the model reads it."""
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


@pytest.fixture
def url(server: Server) -> str:
    return server.url
