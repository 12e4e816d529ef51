"""The HTTP API: the guide's reservation operations and ``capacity.preview`` over aiohttp.

Why it exists: the guide's "HTTP" examples (``POST /api/compute/reservations/create`` with a
bearer token and ``X-Better-Compute: 1``) are one of the doors into the service, beside the CLI
(which calls this API) and the operator. ``app.make_app`` builds the application; the caller
owns the service, the database and the server it runs on (``better-compute dev``, tests, the
benchmarks).

What it must never do: speak SQL, decide policy or place anything. Every route translates: JSON
in, one service call, ``{"data": …}`` or ``{"error": …}`` out. Bad input is always a documented
error answer naming the field, never a traceback and never a 500.

Modules: ``app`` (routes, handlers, middleware, the status table), ``errors`` (the error
envelope and the status of each code), ``openapi`` (the OpenAPI 3.1 document generated from the
input models), ``metrics`` (the per-app Prometheus registry), ``metrics_server`` (the app
that serves that registry on a port of its own, never the API's: it names every tenant),
``serving`` (the runner both composition roots serve them with: timeouts, connection limit,
bounded shutdown).
"""
