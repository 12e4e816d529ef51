// The console's shell: who is signed in, the hash router (#/timeline, #/find,
// #/reservations[/id], #/quota, #/confirmations), and live updates from the event stream.
// Each view is a function that fills <main> and may return { refresh, dispose }; an event
// from /api/compute/events/watch refreshes the view on screen (no page reload).
// It never keeps the token: the HttpOnly cookie is the credential, and a 401 anywhere
// leaves for the sign-in page.

import { api, fill, h, notice, toSignin } from "./lib.js";
import { timelineView, findView } from "./views-timeline.js";
import { reservationsView, reservationView } from "./views-reservations.js";
import { quotaView, confirmationsView } from "./views-account.js";

const main = document.getElementById("main");
const session = { me: null, pools: [] };
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
  const { name, view, args } = route();
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  fill(main, h("p", { class: "loading" }, "Loading…"));
  try {
    current = (await view(main, session, ...args)) || null;
  } catch (error) {
    if (error && error.status === 401) return;
    fill(main, h("div", { class: "error-box", role: "alert" }, "This view could not be shown: ",
      String(error && error.message ? error.message : error), h("br"),
      h("span", { class: "muted" }, "Reload the page; if it keeps failing, the server's log says more.")));
  }
}

/** Refresh the view on screen at most every 400 ms, however many events arrive. */
let pending = null;
function refreshSoon() {
  if (pending) return;
  pending = setTimeout(async () => {
    pending = null;
    updateConfirmCount();
    if (current && current.refresh) {
      try {
        await current.refresh();
      } catch (error) {
        if (!error || error.status !== 401) notice(`Could not refresh: ${error.message || error}`, "bad");
      }
    }
  }, 400);
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
  try {
    session.pools = (await api("pools/list", { tenantId: session.me.tenantId })).items;
  } catch (error) {
    if (error.status === 401) return;
    session.pools = [];
  }
  window.addEventListener("hashchange", show);
  watch();
  updateConfirmCount();
  await show();
}

start().catch((error) => {
  if (error && error.status === 401) toSignin();
});
