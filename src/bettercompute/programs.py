"""The console scripts of the programs that need an extra: each imports its program through
``extras.needs``, so a missing extra is one line naming it, not a traceback.

Why a module apart from ``extras``: it imports every program, and the CLI, which needs only
``extras.needs``, must import none of them. What it must never do: hold logic of a program.
"""

from __future__ import annotations

from bettercompute.extras import KUBECTL, NODE, SERVER, needs


def operator() -> None:
    """``better-compute-operator``."""
    with needs(SERVER, program="better-compute-operator"):
        from bettercompute.operator.running import main
    main()


def node_agent() -> None:
    """``better-compute-deviceplugin``."""
    with needs(NODE, program="better-compute-deviceplugin"):
        from bettercompute.deviceplugin.agent import main
    main()


def kubectl() -> None:
    """``kubectl-bcd``."""
    with needs(KUBECTL, program="kubectl bcd"):
        from bettercompute.kubectl.app import main
    main()
