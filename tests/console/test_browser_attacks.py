"""Attacks on the console, judged by what crosses the network, not by pixels.

* Tenant B's browser never receives tenant A's booking ids, keys or owner: every response
  of a whole B session is recorded and searched.
* A reservation whose key is markup (``<script>``, an ``onerror`` image) shows as text on
  every view and its script never runs.
* A cross-site form POST, from a page of another origin that the browser sends the session
  cookie from, is refused without the CSRF header, and books nothing.
* No cookie, or a token the server does not (or no longer) accept: the sign-in page, and not
  one answer with data.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.console.conftest import Dev, OpenConsole, Page, free_port, screenshot


class Recorder:
    """Every response a page gets, with its body, read as it arrives (an event stream that
    is still open, or a redirect, has none to read: its body counts as empty)."""

    def __init__(self, page: Page) -> None:
        self.reading: list[asyncio.Task[tuple[str, int, str]]] = []
        page.on("response", lambda r: self.reading.append(asyncio.ensure_future(self._read(r))))

    @staticmethod
    async def _read(response: Any) -> tuple[str, int, str]:
        try:
            body = await asyncio.wait_for(response.text(), 5)
        except Exception:
            body = ""
        return response.url, response.status, body

    async def seen(self) -> list[tuple[str, int, str]]:
        return list(await asyncio.gather(*self.reading))


async def test_tenant_b_never_receives_tenant_a_bookings(
    dev: Dev, open_console: OpenConsole
) -> None:
    key = f"acme-secret-{uuid.uuid4().hex[:8]}"
    theirs = await dev.reserve(who="alice", gpus=2, hours=4, start_in_hours=1, key=key)

    page = await open_console(None, "#/timeline")
    recorder = Recorder(page)
    await page.wait_for_selector("#token")
    await page.fill("#token", "bcdev_gina_globex")
    await page.click("button[type=submit]")
    await page.wait_for_selector("#who strong")
    await page.goto("/console/#/timeline/pool_h100")
    await page.reload()
    await page.wait_for_selector("body[data-timeline-drawn='1']")
    # acme's booking reached gina's browser, as "busy" only: the test would see it if leaked.
    busy = await page.evaluate(
        "echarts.getInstanceByDom(document.getElementById('timeline-chart')).getOption()"
        ".series.find(s => s.id === 'bars').data.filter(b => b[4] < 0).length"
    )
    assert busy >= 1
    await screenshot(page, "tenant-b-timeline")
    # Not globex's pool: the server refuses it a Kubernetes binding, and the box is not offered.
    async with page.expect_response("**/api/compute/capacity/preview") as probe:
        await page.goto("/console/#/find/pool_h100")
    assert (await probe.value).status == 400
    await page.wait_for_timeout(100)
    assert not await page.locator("#kubernetes").is_visible()
    for view in ("#/reservations", "#/quota", "#/confirmations"):
        await page.goto(f"/console/{view}")
        await page.wait_for_load_state("networkidle")
    await page.goto(f"/console/#/reservations/{theirs['id']}")
    await page.wait_for_selector(".error-box")

    seen = await recorder.seen()
    api_answers = [s for s in seen if "/api/compute/" in s[0]]
    assert any("pools/timeline" in url and status == 200 for url, status, _ in api_answers)
    for url, _status, body in seen:
        for secret in (theirs["id"], key, "alice@acme"):
            assert secret not in body, f"{secret} reached tenant B in {url}"


HOSTILE = [
    "<script>window.__pwned=1</script>",
    "<img/src=x/onerror=window.__pwned=2>",
    '"><svg/onload=window.__pwned=3>',
]


async def test_a_reservation_named_with_markup_renders_as_text(
    dev: Dev, open_console: OpenConsole
) -> None:
    made = [
        await dev.reserve(who="bob", gpus=1, hours=1, start_in_hours=20 + i, key=k)
        for i, k in enumerate(HOSTILE)
    ]
    page = await open_console("bob", "#/timeline/pool_h100")
    await page.wait_for_selector("body[data-timeline-drawn='1']")
    for r in made:
        await page.locator(f"#my-bookings li[data-id='{r['id']}']").wait_for()
    for key in HOSTILE:
        assert await page.get_by_text(key, exact=True).first.is_visible()
    # The chart's tooltip for one of them: built from text nodes too.
    await page.evaluate(
        """async id => {
          const answer = await fetch('/api/compute/pools/timeline', {method: 'POST',
            headers: {'X-Better-Compute': '1', 'Content-Type': 'application/json'},
            body: JSON.stringify({poolId: 'pool_h100'})}).then(r => r.json());
          const ref = answer.data.reservations.findIndex(r => r.id === id);
          const chart = echarts.getInstanceByDom(document.getElementById('timeline-chart'));
          const series = chart.getOption().series;
          const bars = series.findIndex(s => s.id === 'bars');
          const index = series[bars].data.findIndex(b => b[4] === ref);
          chart.dispatchAction({type: 'showTip', seriesIndex: bars, dataIndex: index});
        }""",
        made[0]["id"],
    )
    await page.wait_for_selector(".tip")
    assert HOSTILE[0] in (await page.text_content(".tip") or "")

    await page.goto("/console/#/reservations")
    for r in made:
        await page.locator(f"#reservations tr[data-id='{r['id']}']").wait_for()
    for key in HOSTILE:
        assert await page.get_by_text(key, exact=True).first.is_visible()
    await page.goto(f"/console/#/reservations/{made[1]['id']}")
    await page.wait_for_selector("#actions")
    assert await page.locator("h1 .name").text_content() == HOSTILE[1]
    await page.wait_for_timeout(300)
    assert await page.evaluate("window.__pwned") is None
    assert await page.locator("script:not([src])").count() == 0
    for r in made:
        await dev.data(
            "reservations/cancel", {"tenantId": "acme", "reservationId": r["id"]}, who="bob"
        )


@dataclass
class OtherOrigin:
    """A site on another origin: another port of the same host, so the browser still sends
    the SameSite=Strict cookie (same site) and only the CSRF header stands in the way."""

    url: str
    pages: dict[str, bytes]

    def serve(self, path: str, html: str) -> str:
        self.pages[path] = html.encode()
        return self.url + path


@pytest.fixture
def other_origin() -> Iterator[OtherOrigin]:
    pages: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path.split("#")[0])
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body or b"not here")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield OtherOrigin(url=f"http://127.0.0.1:{server.server_address[1]}", pages=pages)
    finally:
        server.shutdown()
        server.server_close()


async def test_a_cross_site_post_without_the_csrf_header_is_refused(
    dev: Dev, open_console: OpenConsole, other_origin: OtherOrigin
) -> None:
    page = await open_console("alice", "#/timeline")  # signed in: the cookie is set
    key = f"forged-{uuid.uuid4().hex[:8]}"
    forged = (
        '{"tenantId":"acme","poolId":"pool_h100","devices":[{"class":"gpu","count":1}],'
        f'"duration":"1h","idempotencyKey":"{key}'
    )
    # The classic JSON-by-form forgery: enctype text/plain writes name=value as the body,
    # here a whole create whose key ends in the "=" (a valid key): without the header check
    # it would book.
    forge = other_origin.serve(
        "/forge.html",
        "<!doctype html><form id=f method=POST enctype=text/plain "
        f"action='{dev.url}/api/compute/reservations/create'>"
        f"<input name='{forged}' value='\"}}'></form>"
        "<script>document.getElementById('f').submit()</script>",
    )
    async with page.expect_response("**/api/compute/reservations/create") as answered:
        await page.goto(forge)
    response = await answered.value
    # The browser did send the session cookie: the header alone refused it.
    sent = await response.request.all_headers()
    assert "bcd_session=" in (sent.get("cookie") or "")
    assert response.status == 400
    assert "X-Better-Compute" in await response.text()
    listed = await dev.data("reservations/list", {"tenantId": "acme", "scope": "all", "limit": 200})
    assert f"{key}=" not in [r["idempotencyKey"] for r in listed["items"]]

    # And a script of the other origin gets nothing back from a credentialed fetch.
    await page.goto(other_origin.serve("/read.html", "<!doctype html><p>another site</p>"))
    outcome = await page.evaluate(
        """url => fetch(url, {method: 'POST', credentials: 'include', mode: 'cors',
              headers: {'Content-Type': 'application/json', 'X-Better-Compute': '1'},
              body: '{}'}).then(r => 'read ' + r.status, e => 'blocked')""",
        f"{dev.url}/api/compute/whoami",
    )
    assert outcome == "blocked"


async def test_no_or_a_bad_token_shows_the_sign_in_page_and_no_data(
    dev: Dev, browser: Any, open_console: OpenConsole
) -> None:
    for cookie in (None, "bcdev_not_a_token", "bcdev_alice_acme_revoked"):
        context = await browser.new_context(
            viewport={"width": 1280, "height": 800}, base_url=dev.url
        )
        try:
            if cookie is not None:
                host = dev.url.split("//")[1].split(":")[0]
                await context.add_cookies(
                    [{"name": "bcd_session", "value": cookie, "domain": host, "path": "/"}]
                )
            page = await context.new_page()
            recorder = Recorder(page)
            await page.goto("/console/#/reservations")
            await page.wait_for_url("**/console/signin**")
            await page.wait_for_selector("#token")
            assert await page.locator("#who").count() == 0
            for url, status, body in await recorder.seen():
                if "/api/compute/" in url:
                    assert status == 401, (url, status)
                    assert '"data"' not in body
        finally:
            await context.close()
    # Signing out ends the session: the next view is the sign-in page.
    page = await open_console("alice", "#/quota")
    await page.wait_for_selector("#quota")
    await page.click("#signout")
    await page.wait_for_url("**/console/signin**")
    await page.goto("/console/#/quota")
    await page.wait_for_url("**/console/signin**")
