// The console's shell: who is signed in, the hash router (#/timeline, #/find,
// #/reservations[/id], #/quota, #/confirmations), and live updates from the event stream.
// Each view is a function that fills <main> and may return { refresh, dispose }; an event
// from /api/compute/events/watch refreshes the view on screen (no page reload).
// It never keeps the token: the HttpOnly cookie is the credential, and a 401 anywhere
// leaves for the sign-in page.

import { api, charts, fill, h, notice, toSignin } from "./lib.js";
import { firstTimeline, timelineView, findView } from "./views-timeline.js";
import { reservationsView, reservationView } from "./views-reservations.js";
import { quotaView, confirmationsView } from "./views-account.js";

const main = document.getElementById("main");
const session = { me: null, pools: null, poolsReady: null, prefetch: null };
let current = null;

const ROUTES = {
  timeline: timelineView,
  find: findView,
  reservations: reservationsView,
  quota: quotaView,
  confirmations: confirmationsView,
};

function route() {
  const parts = (location.hash || "#/timeline").replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const [name, ...rest] = parts;
  if (name === "reservations" && rest[0]) return { name, view: reservationView, args: rest };
  if (ROUTES[name]) return { name, view: ROUTES[name], args: rest };
  return { name: "timeline", view: timelineView, args: [] };
}

async function show() {
  if (current && current.dispose) current.dispose();
  current = null;
  // The flags say the timeline on screen is drawn (tests and bench/console.py wait on them).
  delete document.body.dataset.timelineDrawn;
  delete document.body.dataset.timelineComplete;
  const { name, view, args } = route();
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  fill(main, h("p", { class: "loading" }, "Loading…"));
  try {
    // Only the timeline of a pool it was asked for at start goes ahead without the pools.
    const ahead = name === "timeline" && session.prefetch && session.prefetch.poolId === args[0];
    if (!ahead) await session.poolsReady;
    current = (await view(main, session, ...args)) || null;
  } catch (error) {
    if (error && error.status === 401) return;
    fill(main, h("div", { class: "error-box", role: "alert" }, "This view could not be shown: ",
      String(error && error.message ? error.message : error), h("br"),
      h("span", { class: "muted" }, "Reload the page; if it keeps failing, the server's log says more.")));
  }
}

/**
 * Refresh the view on screen once for however many events arrive: 400 ms after the first,
 * or twice as long as the last refresh took, so that a view that is slow to read (a busy
 * pool's timeline) never keeps the server reading it back to back.
 */
let pending = null;
let lastTook = 0;
function refreshSoon() {
  if (pending) return;
  pending = setTimeout(async () => {
    const started = performance.now();
    updateConfirmCount();
    if (current && current.refresh) {
      try {
        await current.refresh();
      } catch (error) {
        if (!error || error.status !== 401) notice(`Could not refresh: ${error.message || error}`, "bad");
      }
    }
    lastTook = performance.now() - started;
    pending = null;
  }, Math.max(400, 2 * lastTook));
}

const EVENT_TYPES = ["pending", "queued", "placed", "repaired", "binding", "binding-rejected", "active",
  "extended", "preempting", "preempted", "failed", "released", "cancelled", "awaiting-confirmation",
  "expired", "reassigned"].map((t) => "reservation." + t);

function watch() {
  const live = document.getElementById("live");
  const source = new EventSource(`/api/compute/events/watch?tenantId=${encodeURIComponent(session.me.tenantId)}`);
  source.addEventListener("open", () => {
    live.textContent = "live";
    live.className = "live on";
    // The stream starts with the next event: what changed before it opened is read again.
    refreshSoon();
  });
  for (const type of EVENT_TYPES) source.addEventListener(type, refreshSoon);
  source.addEventListener("message", refreshSoon);
  source.addEventListener("error", async () => {
    live.textContent = "reconnecting…";
    live.className = "live";
    if (source.readyState === EventSource.CLOSED) {
      // The stream refused us (a 401 among them): whoami says whether the session is over.
      try {
        await api("whoami", {});
        setTimeout(watch, 3000);
      } catch {
        // api() has already left for the sign-in page on a 401.
      }
    }
  });
}

async function updateConfirmCount() {
  const badge = document.getElementById("confirm-count");
  try {
    const list = await api("confirmations/list", { tenantId: session.me.tenantId, state: "pending" });
    const mine = list.items.filter((c) => c.personId === session.me.identityId);
    badge.textContent = String(mine.length);
    badge.hidden = mine.length === 0;
  } catch {
    badge.hidden = true;
  }
}

async function start() {
  document.getElementById("signout").addEventListener("click", async () => {
    try {
      await fetch("/console/session/delete", { method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-Better-Compute": "1" }, body: "{}" });
    } finally {
      location.replace("/console/signin");
    }
  });
  // A view of a named pool asks for its timeline at once, beside whoami and pools.list,
  // rather than after them: on a busy pool it is the slowest answer the page waits for.
  const first = route();
  if (first.name === "timeline" && first.args[0]) {
    const answer = firstTimeline(first.args[0]);
    answer.catch(() => {}); // awaited by the view; a failure is shown there
    session.prefetch = { poolId: first.args[0], answer };
  }
  charts().catch(() => {}); // on its way while the first answers are; a view says if it failed
  try {
    session.me = await api("whoami", {});
  } catch (error) {
    if (error.status !== 401) {
      fill(main, h("div", { class: "error-box", role: "alert" }, `The server could not say who you are: ${error.message}`,
        h("br"), h("span", { class: "muted" }, "Check the server is running, then reload.")));
    }
    return;
  }
  fill(document.getElementById("who"), h("strong", {}, session.me.identityId), ` · ${session.me.tenantId}`,
    session.me.kind && session.me.kind !== "user" ? ` · ${session.me.kind}` : "");
  // The pools (for the pickers) after the first timeline answer: a view of a named pool is
  // drawn without them, and on a busy server the two would slow each other.
  const before = session.prefetch ? session.prefetch.answer.catch(() => null) : Promise.resolve();
  session.poolsReady = before
    .then(() => api("pools/list", { tenantId: session.me.tenantId }))
    .then((answer) => answer.items, (error) => {
      if (error.status === 401) throw error;
      return [];
    })
    .then((items) => { session.pools = items; return items; });
  session.poolsReady.catch(() => {});
  window.addEventListener("hashchange", show);
  await show();
  // After the first view: on a small server these would compete with its answers.
  watch();
  updateConfirmCount();
}

start().catch((error) => {
  if (error && error.status === 401) toSignin();
});
