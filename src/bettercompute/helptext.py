"""What both command lines (``better-compute`` and ``kubectl bcd``) do to typer's help text.

Why it exists: typer 0.29's rich help prints a type placeholder after every option, switches
included (``--nvlink <bool>``), which reads as if the switch took a value. A switch takes none,
so its placeholder is dropped here, once, for both programs; everything else typer prints as
it does. Here at the top of the package because the two CLIs may not import each other.

What it must never do: change how a command line is parsed, or hide the placeholder of an
option that does take a value.
"""

from __future__ import annotations

from typing import Any

from typer import core

_original = core.TyperOption.display_type_rich


def _display_type_rich(self: core.TyperOption, ctx: Any) -> str | None:
    if self.is_flag and not self.count:
        return None
    return _original(self, ctx)


def plain_switches() -> None:
    """Show switches (``--nvlink``, ``--help``) without a ``<bool>`` placeholder."""
    core.TyperOption.display_type_rich = _display_type_rich  # type: ignore[method-assign]
