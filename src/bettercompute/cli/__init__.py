"""``better-compute``: the command line door to the reservations API.

Why a package of its own: the CLI is one of the doors (beside the HTTP API and the operator). It
turns flags into the guide's JSON bodies, sends them over HTTP with ``httpx``, and turns the
answer back into tables, JSON or YAML. Modules:

- ``app``: the typer commands and ``main`` (exit codes: ``core.exits``, shared with kubectl bcd);
- ``options``: the flags the commands share, and the checks that run as they are parsed;
- ``settings``: URL, token, tenant and output from flags, environment and the config file;
- ``parsing``: pure readers for durations, times (``+12h``, ISO 8601, epoch ms), query paths;
- ``bodies``: pure builders of the request bodies the server expects;
- ``client``: the HTTP calls and the ``Failure`` every command reports the same way;
- ``output``: tables for people, the server's data unchanged for programs;
- ``waiting``: polling a queued reservation until the ``--wait`` deadline.

What this package must never do: import ``store``, ``service`` or ``api`` (it is a client and
speaks only HTTP), decide anything the server decides, or show a Python traceback to a user.
``bettercompute.dev`` is imported only inside the ``dev`` command, so ``--help`` never loads it.
"""
