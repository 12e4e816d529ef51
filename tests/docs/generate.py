"""Write the generated reference pages of the site: the HTTP API, the CLI and ``kubectl bcd``.

Why it exists: these pages describe what the code accepts, so they are made from the code (the
OpenAPI document, the typer apps) and committed. Run it after changing an operation, a model, a
command or an option::

    .venv/bin/python -m tests.docs.generate           # rewrite the pages that changed
    .venv/bin/python -m tests.docs.generate --check   # exit 1 naming the stale ones

``tests/docs/test_references.py`` runs the same functions and fails when a committed page
differs. What it must never do: write anywhere but ``docs/reference/``, or make a page that
depends on the machine, the terminal or the environment it runs in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests.docs import cli_md, openapi_md

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
COMMAND = ".venv/bin/python -m tests.docs.generate"


def http_api() -> str:
    from bettercompute.api import openapi

    return openapi_md.render(
        openapi.document(),
        title="HTTP API reference",
        intro=(
            "Every operation of the HTTP API, with its request body, its answer and its errors."
            " This page is made from the OpenAPI document the server itself serves at"
            " `GET /api/compute/openapi.json`. What the operations do to a reservation, its"
            " states and conditions, and what to do about each error code:"
            " [Reservations](../reservations.md). The server's limits, timeouts and metrics:"
            " [The HTTP server](../http-api.md)."
        ),
        source="`bettercompute.api.openapi.document()`",
    )


def cli() -> str:
    from bettercompute.cli.app import app

    return cli_md.render(
        app,
        prog="better-compute",
        title="CLI reference: `better-compute`",
        intro=(
            "Every command of `better-compute` with its arguments, options, defaults and"
            " examples, as `--help` prints them. Every command also takes `-h` or `--help`."
            " A refusal prints `Error CODE: message` and exits 1, a usage error exits 2, and a"
            " server that cannot be reached exits 3. A walk through the commands is in the"
            " [introduction](../index.md)."
        ),
        source="`bettercompute.cli.app`",
    )


def kubectl_bcd() -> str:
    from bettercompute.kubectl.app import app

    return cli_md.render(
        app,
        prog="kubectl bcd",
        title="kubectl plugin reference: `kubectl bcd`",
        intro=(
            "Every command of the kubectl plugin with its arguments, options, defaults and"
            " examples, as `--help` prints them. How to install it, which cluster it talks to,"
            " its exit codes and what each command prints:"
            " [The kubectl plugin](../kubectl-plugin.md)."
        ),
        source="`bettercompute.kubectl.app`",
    )


#: Each generated page, by its path under the repository root, and what makes it.
PAGES: Mapping[str, Callable[[], str]] = {
    "docs/reference/http-api.md": http_api,
    "docs/reference/cli.md": cli,
    "docs/reference/kubectl-bcd.md": kubectl_bcd,
}


def stale() -> list[str]:
    """The pages whose committed text differs from what the code makes now."""
    found = []
    for path, make in PAGES.items():
        target = ROOT / path
        if not target.is_file() or target.read_text(encoding="utf-8") != make():
            found.append(path)
    return found


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["--check"]:
        old = stale()
        for path in old:
            print(f"{path} is out of date: run {COMMAND}", file=sys.stderr)
        return 1 if old else 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for path, make in PAGES.items():
        target = ROOT / path
        text = make()
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
