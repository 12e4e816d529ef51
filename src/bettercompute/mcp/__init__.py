"""``better-compute mcp``: the reservations API as tools an AI agent calls over MCP (stdio).

Why a package of its own: an agent spends money on the person's behalf, so the door it uses
must keep the same promises the CLI keeps (one idempotency key per request, kept across a
retry; the server's refusal shown with its code) while speaking the Model Context Protocol
instead of a terminal. ``door`` holds those rules over any client with ``call(operation,
body)``; ``server`` lays them out as MCP tools with the official SDK (the ``mcp`` extra).

What this package must never do: speak HTTP itself (the CLI's ``ApiClient`` is handed in by
the ``better-compute mcp`` command), import ``bettercompute.cli`` (the layers contract puts
the CLI above it), reach the store or the service, write to stdout (the stdio transport owns
it), or make a request the agent did not ask for under a new key.
"""
