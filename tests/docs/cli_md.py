"""A command-line reference page, written from a typer app's own command tree.

Why it exists: the options, defaults and examples a person reads on the site must be the ones
``--help`` prints. So the page is not written by hand: it is read from the app, through
``typer.main.get_command`` and the click-style tree it returns (every command and subcommand,
its help and epilog, its arguments and options as ``--help`` shows them), and a test fails
when the committed page differs.

What it must never do: run a command, read the environment or the terminal, or word anything
itself that ``--help`` words: it only arranges the app's own text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer

from tests.docs import mdtext

#: The panel of options that name none (typer's own name for it).
DEFAULT_PANEL = "Options"


def render(app: typer.Typer, *, prog: str, title: str, intro: str, source: str) -> str:
    """The reference page of ``app``, run as ``prog``."""
    found = commands(app, prog=prog)
    blocks = [mdtext.GENERATED.format(source=source), f"# {title}", intro]
    blocks.append("## Commands")
    blocks.append(
        mdtext.table(
            ["Command", "What it does"],
            (
                [f"[{mdtext.code(ctx.command_path)}](#{_anchor(ctx.command_path)})", _short(cmd)]
                for cmd, ctx in found
            ),
        )
    )
    for command, ctx in found:
        blocks.extend(_command(command, ctx))
    return mdtext.page(blocks)


def commands(app: typer.Typer, *, prog: str) -> list[tuple[Any, Any]]:
    """Every visible command of ``app`` run as ``prog``, with the context its help is
    formatted in: the app itself first, then each command and subcommand as help lists them."""
    root = typer.main.get_command(app)
    return list(_walk(root, _context(root, name=prog, parent=None)))


def options(command: Any, ctx: Any) -> list[Any]:
    """The parameters ``--help`` lists for ``command``, without the help option itself."""
    return [
        p
        for p in command.get_params(ctx)
        if p.get_help_record(ctx) is not None and not _is_help(p, ctx)
    ]


def _walk(command: Any, ctx: Any) -> Iterator[tuple[Any, Any]]:
    """Every visible command under ``command``, itself first, in the order help lists them."""
    if getattr(command, "hidden", False):
        return
    yield command, ctx
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                yield from _walk(sub, _context(sub, name=name, parent=ctx))


def _context(command: Any, *, name: str, parent: Any) -> Any:
    """The context ``--help`` would format ``command`` in, without parsing anything."""
    return command.context_class(command, info_name=name, parent=parent, **command.context_settings)


def _command(command: Any, ctx: Any) -> list[str]:
    path = ctx.command_path
    blocks = [f"## {mdtext.code(path)}"]
    blocks.extend(mdtext.help_blocks(_help(command)))
    usage = " ".join([path, *command.collect_usage_pieces(ctx)])
    blocks.append(f"```text\n{usage}\n```")
    params = options(command, ctx)
    arguments = [p for p in params if p.param_type_name == "argument"]
    flags = [p for p in params if p.param_type_name != "argument"]
    if arguments:
        blocks.append("**Arguments**")
        blocks.append(mdtext.table(["Argument", "Description"], _rows(arguments, ctx)))
    for panel, members in _panels(flags):
        blocks.append(f"**{mdtext.text(panel)}**")
        blocks.append(mdtext.table(["Option", "Description"], _rows(members, ctx)))
    if hasattr(command, "list_commands"):
        subs = [
            (name, command.get_command(ctx, name))
            for name in command.list_commands(ctx)
            if not getattr(command.get_command(ctx, name), "hidden", False)
        ]
        if subs:
            blocks.append("**Commands**")
            blocks.append(
                mdtext.table(
                    ["Command", "What it does"],
                    (
                        [f"[{mdtext.code(name)}](#{_anchor(f'{path} {name}')})", _short(sub)]
                        for name, sub in subs
                    ),
                )
            )
    if command.epilog:
        blocks.extend(mdtext.help_blocks(command.epilog))
    return blocks


def _help(command: Any) -> str:
    """The help as ``--help`` has it (typer has already cleaned a docstring's indentation;
    an indented paragraph is an example and stays one)."""
    return str(command.help or command.short_help or "").strip("\n")


def _short(command: Any) -> str:
    """The first paragraph of a command's help, as a table cell."""
    first = _help(command).split("\n\n")[0]
    return mdtext.cell(first)


def _is_help(param: Any, ctx: Any) -> bool:
    return set(param.opts) <= set(ctx.help_option_names) and bool(param.opts)


def _panels(options: list[Any]) -> list[tuple[str, list[Any]]]:
    """Options by help panel: the unnamed panel first, then the others as they first appear."""
    panels: dict[str, list[Any]] = {DEFAULT_PANEL: []}
    for option in options:
        panel = getattr(option, "rich_help_panel", None)
        name = panel if isinstance(panel, str) and panel else DEFAULT_PANEL
        panels.setdefault(name, []).append(option)
    return [(name, members) for name, members in panels.items() if members]


def _rows(params: list[Any], ctx: Any) -> Iterator[list[str]]:
    for param in params:
        names, description = param.get_help_record(ctx)
        yield [mdtext.code(names), mdtext.cell(description)]


def _anchor(path: str) -> str:
    """The id the site gives the heading ``## `path` ``: lower case, spaces as dashes."""
    return "-".join(path.lower().split())
