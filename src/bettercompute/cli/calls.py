"""What every command does around its call to the server: report a refusal, find the tenant.

Why one place: a refusal must read the same from every command (``Error CODE: message`` and
the exit code of its kind from ``core.exits``: 2 usage, 3 unreachable, 4 not found, …), and
every command finds its tenant the same way (flag, environment, config file, else the token's
own from ``whoami``).
The command modules (``app``, ``confirmations``, ``usage``) share these.

What it must never do: print anything but the refusal it was handed, or guess a tenant the
server did not name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from bettercompute.cli import client, output, parsing, settings
from bettercompute.cli.settings import Output


@contextlib.contextmanager
def reporting(chosen: Output | None) -> Iterator[None]:
    """Turn a ``Failure`` into ``Error CODE: message`` and its exit code; usage errors of
    readers into typer's own usage error (exit 2) naming the option."""
    try:
        yield
    except client.Failure as e:
        output.failure(e, output=chosen or Output.TABLE)
        raise typer.Exit(e.exit_code) from None
    except parsing.ParseError as e:
        raise typer.BadParameter(str(e), param_hint=f"'{e.option}'" if e.option else None) from None


def tenant(found: settings.Settings, *, timeout_s: float = 30.0) -> str:
    """The tenant given (flag, environment, config file), else the token's own (``whoami``)."""
    if found.tenant or not (found.url and found.token):
        return settings.require_tenant(found)
    with client.ApiClient(url=found.url, token=found.token, timeout_s=timeout_s) as api:
        who = api.call("whoami", {})
    named = who.get("tenantId") if isinstance(who, dict) else None
    if not isinstance(named, str) or not named:
        return settings.require_tenant(found)
    return named
