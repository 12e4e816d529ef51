"""Which optional dependencies each program needs, and the one line that says so when missing.

Why it exists: the base install (``pip install better-compute``) is the CLI alone; the operator,
the node agent, ``kubectl bcd`` and ``better-compute dev`` each come with an extra (``server``,
``node``, ``kubectl``, ``dev``). A program started without its extra would die in a traceback
about a module its user never heard of. So each imports its program inside ``needs`` (the
console scripts through ``bettercompute.programs``, ``dev`` in the CLI), and a missing module is
turned into ``better-compute-operator needs the 'server' extra: pip install
'better-compute[server]' (no module named 'kopf')`` and exit status 1.

What it must never do: catch anything but the import of the program (an error the program
raises later is the program's own), or hide a module of ours that is missing (a broken install
is not a missing extra).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

#: The extras, as pyproject.toml names them (the install command quotes them).
SERVER, NODE, KUBECTL, DEV = "server", "node", "kubectl", "dev"


class MissingExtra(SystemExit):
    """The program cannot start without an extra; the message says which and how to add it."""


def message(program: str, extra: str, module: str) -> str:
    return (
        f"{program} needs the '{extra}' extra: pip install 'better-compute[{extra}]'"
        f" (no module named '{module}')"
    )


@contextlib.contextmanager
def needs(extra: str, *, program: str) -> Iterator[None]:
    """Import the program inside this block: a missing dependency ends it with one line."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if not missing or missing.split(".")[0] == "bettercompute":
            raise
        sys.stderr.write(message(program, extra, missing.split(".")[0]) + "\n")
        raise MissingExtra(1) from None
