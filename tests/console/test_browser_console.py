"""The console in a real Chromium against a real `better-compute dev`: a newcomer signs in,
sees the demo pool's bookings on the timeline, finds a window, reserves it and sees it appear
without a reload, releases it, approves what an agent asked, and watches the quota change.

The timeline is a canvas, so the tests read what the page says beside it (the lists of one's
own and waiting bookings, the chart's booking count) and the chart's own data through
ECharts' public ``getInstanceByDom``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tests.console.conftest import Dev, OpenConsole, Page, screenshot

CHART = "echarts.getInstanceByDom(document.getElementById('timeline-chart')).getOption()"


async def _timeline(page: Page, pool: str = "pool_h100") -> None:
    await page.goto(f"/console/#/timeline/{pool}")
    await page.reload()  # a fresh page: the drawn flag is set once per page
    await page.wait_for_selector("body[data-timeline-drawn='1']")


async def test_signing_in_shows_the_pool_timeline_with_its_bookings(
    dev: Dev, open_console: OpenConsole
) -> None:
    now = await dev.reserve(who="alice", gpus=4, hours=8, key=f"train-{uuid.uuid4().hex[:6]}")
    later = await dev.reserve(who="alice", gpus=2, hours=24, start_in_hours=30)
    other = await dev.reserve(who="gina", gpus=1, hours=6, start_in_hours=2)
    # More of the scene the screenshot shows: a colleague's booking and globex's.
    scene = [
        await dev.reserve(who="bob", gpus=2, hours=10, start_in_hours=6, key="eval-nightly"),
        await dev.reserve(who="gina", gpus=4, hours=12, start_in_hours=20),
        await dev.reserve(who="alice", gpus=1, hours=30, start_in_hours=9, key="finetune-7b"),
    ]

    page = await open_console(None, "#/timeline")
    await page.wait_for_url("**/console/signin**")
    await page.wait_for_selector("#token")
    await screenshot(page, "signin")
    await page.fill("#token", "bcdev_alice_acme")
    await page.click("button[type=submit]")
    await page.wait_for_selector("#who strong")
    assert await page.text_content("#who strong") == "alice@acme"

    await _timeline(page)
    mine = page.locator("#my-bookings")
    for made in (now, later):
        await mine.locator(f"li[data-id='{made['id']}']").wait_for()
    # Everyone's bookings are drawn (gina's as "busy"), one bar per (reservation, node).
    assert int(await page.get_attribute("#timeline-chart", "data-bookings") or "0") >= 3
    assert other["id"] not in await page.content()

    # A node opens to a row per device, from the keyboard.
    toggle = page.locator("#node-toggles button").first
    await toggle.focus()
    await page.keyboard.press("Enter")
    assert await toggle.get_attribute("aria-expanded") == "true"
    assert await page.evaluate(f"{CHART}.yAxis[0].data.length") == 2 + 8
    await screenshot(page, "timeline")

    # Enter on one's own booking opens it.
    await mine.locator(f"li[data-id='{now['id']}']").focus()
    await page.keyboard.press("Enter")
    await page.wait_for_url(f"**/#/reservations/{now['id']}")
    await page.wait_for_selector("#actions")
    # The simulated node binds it: the page follows live, to active with its devices.
    await page.wait_for_selector(".view-head .state-active", timeout=30_000)
    await screenshot(page, "reservation")
    await dev.data("reservations/release", {"tenantId": "acme", "reservationId": now["id"]})
    for made, who in [(later, "alice"), *((r, "bob") for r in scene)]:
        tenant = "globex" if made["tenantId"] == "globex" else "acme"
        body = {"tenantId": tenant, "reservationId": made["id"]}
        await dev.data("reservations/cancel", body, who="gina" if tenant == "globex" else who)


async def test_find_a_window_reserve_it_see_it_live_and_release_it(
    dev: Dev, open_console: OpenConsole
) -> None:
    page = await open_console("alice", "#/find/pool_h100")
    await page.wait_for_selector("body[data-timeline-drawn='1']")
    # alice's tenant owns pool_h100, whose policy allows Kubernetes: the box is offered.
    await page.locator("#kubernetes").wait_for()
    await page.fill("#count", "2")
    await page.fill("#duration", "3h")
    await page.click("#find-form button[type=submit]")
    await page.wait_for_selector("ol.windows li")
    windows = await page.evaluate(f"{CHART}.series.find(s => s.id === 'windows').data.length")
    assert windows >= 1
    await page.click("ol.windows li button[data-window='0']")
    key = await page.text_content("#idempotency-key") or ""
    assert key.startswith("console-")
    await screenshot(page, "find")
    await page.click("#reserve")
    await page.wait_for_selector("#booking-outcome .ok")
    outcome = await page.text_content("#booking-outcome") or ""
    rid = outcome.split("Reserved: ")[1].split(" ")[0]
    made = await dev.data("reservations/get", {"tenantId": "acme", "reservationId": rid})
    assert made["idempotencyKey"] == key
    await page.locator(f"#my-bookings li[data-id='{rid}']").wait_for()

    # A booking made elsewhere appears on an open timeline without a reload.
    await _timeline(page)
    await page.wait_for_selector("#live.on")  # the event stream is open
    await page.evaluate("window.__sameDocument = true")
    # A keyboard user on a row keeps the focus there through the update.
    await page.locator(f"#my-bookings li[data-id='{rid}']").focus()
    elsewhere = await dev.reserve(who="alice", gpus=1, hours=1, start_in_hours=5)
    await page.locator(f"#my-bookings li[data-id='{elsewhere['id']}']").wait_for()
    assert await page.evaluate("window.__sameDocument") is True
    assert await page.evaluate("document.activeElement.dataset.id") == rid

    # Release, after the page asks.
    await page.goto(f"/console/#/reservations/{rid}")
    await page.click("#release")
    assert await page.locator("#confirm-dialog").is_visible()
    await screenshot(page, "release-confirm")
    await page.click("#confirm-ok")
    await page.wait_for_selector("#action-outcome .ok")
    got = await dev.data("reservations/get", {"tenantId": "acme", "reservationId": rid})
    assert got["state"] in ("releasing", "released", "cancelled")
    await dev.data("reservations/cancel", {"tenantId": "acme", "reservationId": elsewhere["id"]})


async def test_reservations_list_filters_and_detail(dev: Dev, open_console: OpenConsole) -> None:
    key = f"vision-{uuid.uuid4().hex[:6]}"
    made = await dev.reserve(who="alice", gpus=1, hours=2, start_in_hours=50, key=key)
    page = await open_console("alice", "#/reservations")
    await page.locator(f"#reservations tr[data-id='{made['id']}']").wait_for()
    await page.fill("#filter-label", key)
    assert await page.locator("#reservations tbody tr").count() == 1
    await screenshot(page, "reservations")
    await page.locator(f"#reservations tr[data-id='{made['id']}']").focus()
    await page.keyboard.press(" ")
    await page.wait_for_selector("#actions #cancel")
    assert await page.locator("h1 .name").text_content() == key
    await page.click("#cancel")
    await page.click("#confirm-ok")
    await page.wait_for_selector("#action-outcome .ok")
    got = await dev.data("reservations/get", {"tenantId": "acme", "reservationId": made["id"]})
    assert got["state"] == "cancelled"


async def test_approving_what_an_agent_asked(dev: Dev, open_console: OpenConsole) -> None:
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": "pool_h100",
        "devices": [{"class": "gpu", "count": 6}],
        "duration": "2h",
        "start": int(time.time() * 1000) + 72 * 3600_000,
        "idempotencyKey": f"agent-{uuid.uuid4().hex[:6]}",
    }
    asked = await dev.call("reservations/create", body, who="assistant")
    assert asked.json()["error"]["code"] == "CONFIRMATION_REQUIRED", asked.text
    cid = asked.json()["error"]["details"]["confirmationId"]

    page = await open_console("alice", "#/confirmations")
    card = page.locator(f"#confirmations-pending li[data-id='{cid}']")
    await card.wait_for()
    assert "assistant@acme" in (await card.text_content() or "")
    await screenshot(page, "confirmations")
    await card.locator("button.approve").click()
    await page.locator(f"#confirmations-decided tr[data-id='{cid}']").wait_for()
    listed = await dev.data("confirmations/list", {"tenantId": "acme"})
    assert [c["state"] for c in listed["items"] if c["id"] == cid] == ["approved"]
    # The agent's retry with the same key now goes ahead.
    retried = await dev.call("reservations/create", body, who="assistant")
    assert retried.status_code == 200, retried.text
    rid = retried.json()["data"]["id"]
    await dev.data("reservations/cancel", {"tenantId": "acme", "reservationId": rid})


async def test_the_quota_gauges_follow_a_new_booking(dev: Dev, open_console: OpenConsole) -> None:
    page = await open_console("alice", "#/quota")
    used = page.locator("#quota .gauge[data-resource='gpu:H100'] .used")
    await used.wait_for()
    before = int((await used.text_content() or "").split()[-1])
    await page.wait_for_selector("#live.on")
    made = await dev.reserve(who="alice", gpus=1, hours=1, start_in_hours=0.5)
    await page.wait_for_function(
        "n => Number(document.querySelector(\"#quota .gauge[data-resource='gpu:H100'] .used\")"
        ".textContent.split(' ').pop()) === n",
        arg=before + 1,
    )
    await page.wait_for_selector("#usage-chart canvas")
    await screenshot(page, "quota")
    await dev.data("reservations/cancel", {"tenantId": "acme", "reservationId": made["id"]})
