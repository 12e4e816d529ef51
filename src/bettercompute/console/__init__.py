"""The web console's pages: the shipped files under ``static/`` and how the API's server serves
them, with the headers that keep a browser from running anything else.

Why it exists: the console is served by the same aiohttp app as the HTTP API (one port, one
origin, so the API's CSRF header and the session cookie need no CORS), and its files ship in
the wheel, so an air-gapped cluster needs no CDN and no Node toolchain. ``install`` adds the
routes; ``api.app.make_app`` calls it, and ``api.sessions`` adds the sign-in cookie beside it.

Routes:

* ``GET /`` and ``GET /console``: 302 to ``/console/``;
* ``GET /console/``: ``static/index.html``; ``GET /console/signin``: ``static/signin.html``;
* ``GET /console/assets/<path>``: the file ``static/<path>`` (``/console/assets/app.js``,
  ``/console/assets/vendor/echarts.min.js``); a path with an empty, ``.``/``..`` or hidden
  segment, or one leading outside ``static/``, is a 404 like any unknown route.

Every answer under ``/`` and ``/console`` (files, redirects, refusals, the session routes)
carries ``SECURITY_HEADERS``: a Content-Security-Policy that allows only this origin's scripts
and styles (no inline script, no ``eval``), no framing, no referrer, no MIME sniffing.

What it must never do: serve a file from outside ``static/``, read a credential, or answer
anything but the shipped files (no templating: the pages hold no data, the API gives it).
"""

from __future__ import annotations

import mimetypes
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The shipped files (package data of the wheel).
STATIC = Path(__file__).resolve().parent / "static"
#: Where the console lives; ``/`` sends a browser here.
BASE = "/console/"
SIGNIN = "/console/signin"
ASSETS = "/console/assets/"

#: Only this origin's scripts, styles, images and API; nothing inline, no frames, no plugins.
#: ``img-src data:`` is for the images ECharts draws into (a canvas export, icons).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

# Types named here rather than guessed from the host's mime tables, which differ by system
# (a module script served as text/plain is refused by the browser under nosniff).
_TYPES: Mapping[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".txt": "text/plain; charset=utf-8",
    ".woff2": "font/woff2",
}


def install(app: web.Application, *, static: Path = STATIC) -> None:
    """Serve the console from ``static`` on ``app``, with ``SECURITY_HEADERS`` on each of its
    answers."""
    root = static.resolve()
    app.router.add_get("/", _to_console)
    app.router.add_get("/console", _to_console)
    app.router.add_get(BASE, _page(root / "index.html"), name="console.index")
    app.router.add_get(SIGNIN, _page(root / "signin.html"), name="console.signin")
    app.router.add_get(ASSETS + "{path:.+}", _assets(root), name="console.assets")
    app.on_response_prepare.append(_secure)


def is_console_path(path: str) -> bool:
    """Whether ``path`` is one of the console's (the headers go on these)."""
    return path == "/" or path == "/console" or path.startswith("/console/")


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    if is_console_path(request.path):
        response.headers.update(SECURITY_HEADERS)


async def _to_console(request: web.Request) -> web.StreamResponse:
    # Returned, not raised: the API's pipeline turns every raised HTTP exception into an error.
    return web.Response(status=302, headers={"Location": BASE})


def _page(path: Path) -> Handler:
    async def page(request: web.Request) -> web.StreamResponse:
        return _file(path)

    return page


def _assets(root: Path) -> Handler:
    async def asset(request: web.Request) -> web.StreamResponse:
        path = resolve(root, request.match_info["path"])
        if path is None:
            raise web.HTTPNotFound()
        return _file(path)

    return asset


def resolve(root: Path, relative: str) -> Path | None:
    """The file ``relative`` names under ``root``, or ``None`` when it names none or would
    leave ``root`` (``..``, an absolute path, a backslash, a hidden file, a link outward)."""
    parts = relative.split("/")
    if any(
        not part or part.startswith(".") or "\\" in part or "\x00" in part or ":" in part
        for part in parts
    ):
        return None
    path = root.joinpath(*parts).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path


def _file(path: Path) -> web.StreamResponse:
    if not path.is_file():
        raise web.HTTPNotFound()
    kind = _TYPES.get(path.suffix.lower()) or (
        mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    )
    # Revalidated on each load (the file's ETag and Last-Modified make that a 304): the URLs
    # carry no version, so an upgraded server must never meet a stale script.
    return web.FileResponse(path, headers={"Content-Type": kind, "Cache-Control": "no-cache"})
