"""The generated reference pages are current: made again from the code, they match the
committed ones; and they cover every operation, command and option."""

from __future__ import annotations

import difflib
from collections.abc import Callable

import pytest
import typer

from tests.docs import cli_md, generate


@pytest.mark.parametrize("path", sorted(generate.PAGES))
def test_committed_page_matches_the_code(path: str) -> None:
    target = generate.ROOT / path
    committed = target.read_text(encoding="utf-8") if target.is_file() else ""
    made = generate.PAGES[path]()
    if committed != made:
        diff = difflib.unified_diff(
            committed.splitlines(), made.splitlines(), "committed", "generated", lineterm=""
        )
        shown = "\n".join(list(diff)[:60])
        pytest.fail(f"{path} is out of date: run `{generate.COMMAND}` to update it\n{shown}")


def test_http_reference_has_every_operation() -> None:
    from bettercompute.api import openapi

    page = generate.http_api()
    for path, item in openapi.document()["paths"].items():
        for method in item:
            assert f"## `{method.upper()} {path}`" in page


def _cli() -> typer.Typer:
    from bettercompute.cli.app import app

    return app


def _kubectl() -> typer.Typer:
    from bettercompute.kubectl.app import app

    return app


@pytest.mark.parametrize(
    ("app", "prog", "make"),
    [(_cli, "better-compute", generate.cli), (_kubectl, "kubectl bcd", generate.kubectl_bcd)],
)
def test_cli_reference_has_every_command_and_option(
    app: Callable[[], typer.Typer], prog: str, make: Callable[[], str]
) -> None:
    page = make()
    for command, ctx in cli_md.commands(app(), prog=prog):
        assert f"## `{ctx.command_path}`" in page
        for param in cli_md.options(command, ctx):
            names = param.get_help_record(ctx)[0]
            assert names.split()[0].rstrip(",") in page, (ctx.command_path, names)
