// The Timeline view (a pool's bookings, now and ahead) and Find a window (capacity/search's
// earliest windows drawn on the same timeline, then a create with a key the page shows).

import { PALETTE, api, activatable, charts, duration, errorBox, fill, h, newKey, notice, time } from "./lib.js";
import { drawTimeline } from "./timeline.js";

const ENDED = new Set(["released", "expired", "cancelled", "failed"]);
const LISTED = 50;

const STATE_NAMES = [
  ["active", "active"], ["binding", "binding"], ["placed", "placed"], ["releasing", "releasing"],
  ["spot", "spot"], ["ended", "ended"], ["busy", "busy (someone else)"],
];

function legend() {
  const items = STATE_NAMES.map(([key, text]) => {
    const swatch = h("span", { class: "swatch" });
    swatch.style.background = PALETTE[key];
    return h("li", {}, swatch, text);
  });
  const windowSwatch = h("span", { class: "swatch window" });
  const bad = h("span", { class: "swatch" });
  bad.style.background = "rgba(213,94,0,0.35)";
  const maintenance = h("span", { class: "swatch" });
  maintenance.style.background = "rgba(0,0,0,0.2)";
  const now = h("span", { class: "swatch now" });
  return h("ul", { class: "legend", "aria-label": "Legend" }, items,
    h("li", {}, windowSwatch, "free window"), h("li", {}, bad, "unhealthy"),
    h("li", {}, maintenance, "maintenance"), h("li", {}, now, "now"));
}

function poolPicker(session, chosen, onChange) {
  const select = h("select", { id: "pool", name: "pool" },
    session.pools.map((p) => h("option", { value: p.poolId, selected: p.poolId === chosen },
      `${p.name} (${p.poolId})`)));
  select.addEventListener("change", () => onChange(select.value));
  return h("label", { class: "field" }, "Pool ", select);
}

function noPools() {
  return h("div", { class: "empty" }, h("h2", {}, "No pools yet"),
    h("p", {}, "Your tenant owns no pool and is offered none. Ask your platform team for an offer, or try ",
      h("code", {}, "better-compute dev"), ", whose demo tenant acme owns two."));
}

/** What the timeline first shows: half a day back to four days ahead. */
const FIRST_PAST_MS = 12 * 3600e3;
const FIRST_AHEAD_MS = 4 * 86400e3;

/**
 * The timeline of the span first on screen: on a pool with thousands of bookings it is a
 * fraction of the whole answer, so the grid is drawn while the rest is still on its way.
 */
export function firstTimeline(poolId) {
  const now = Date.now();
  return api("pools/timeline", { poolId, from: Math.round(now - FIRST_PAST_MS), to: Math.round(now + FIRST_AHEAD_MS) });
}

/** Record that the timeline is on screen (the bench reads the mark's time). */
function markDrawn(container, tl) {
  // The first timeline this page drew is what bench/console.py times.
  if (!performance.getEntriesByName("timeline-drawn").length) performance.mark("timeline-drawn");
  container.dataset.bookings = String(tl.bookings.length);
  document.body.dataset.timelineDrawn = "1";
}

/** A pool timeline with its legend, zoom buttons, node toggles and the caller's own lists. */
function timelinePanel(session, poolId, { onPickWindow } = {}) {
  const chartBox = h("div", { class: "chart", id: "timeline-chart", role: "img",
    "aria-label": "Bookings per node over time; the lists beside it say the same in words." });
  const waiting = h("ul", { class: "plain", id: "pending-list" });
  const mine = h("ul", { class: "plain", id: "my-bookings" });
  const nodes = h("div", { class: "node-toggles", id: "node-toggles" });
  const status = h("p", { class: "muted", id: "timeline-status" });
  const zoomButtons = h("div", { class: "zoom", role: "group", "aria-label": "Zoom" });
  const panel = h("div", { class: "timeline-panel" },
    h("div", { class: "toolbar" }, zoomButtons, legend()),
    h("div", { class: "tl-layout" }, h("div", {}, chartBox, status),
      h("aside", { class: "side" }, h("h3", {}, "Waiting (pending, queued)"), waiting,
        h("h3", {}, "Yours in this pool"), mine)),
    h("h3", {}, "Nodes"), h("p", { class: "muted" }, "Open a node to see a row per device (or click its name on the chart)."), nodes);
  let drawn = null;
  let tl = null;

  function lists() {
    fill(waiting, tl.pending.length ? tl.pending.map((p) => activatable(
      h("li", { class: "row" }, h("span", { class: "state-tag" }, p.state), " ", p.name || p.id,
        ` · ${plural(p.gpus, "device")} · wants `, time(p.requestedStart)),
      () => { location.hash = `#/reservations/${encodeURIComponent(p.id)}`; }, `Open ${p.name || p.id}`))
      : h("li", { class: "muted" }, "Nothing waiting."));
    // The live ones, soonest first, at most LISTED: a busy pool's tenant may hold thousands,
    // all of them on the grid; the list is for reading and the keyboard.
    const live = tl.reservations.filter((r) => !ENDED.has(r.state) && r.end > tl.now).sort((a, b) => a.start - b.start);
    const own = live.slice(0, LISTED);
    fill(mine, own.length ? own.map((r) => activatable(
      h("li", { class: "row", dataset: { id: r.id } }, colourTag(r), " ", h("span", { class: "name" }, r.name || r.id),
        h("br"), h("span", { class: "muted" }, `${plural(r.gpus, "device")} · `), time(r.start), " → ", time(r.end)),
      () => { location.hash = `#/reservations/${encodeURIComponent(r.id)}`; }, `Open ${r.name || r.id}`))
      : h("li", { class: "muted" }, "None from the last day to the horizon. Use Find a window to book."),
    live.length > LISTED ? h("li", { class: "muted" }, `… and ${live.length - LISTED} more: see `,
      h("a", { href: "#/reservations" }, "Reservations"), ".") : null);
    fill(nodes, tl.nodes.map((node, n) => {
      const button = h("button", { type: "button", "aria-expanded": drawn && drawn.isExpanded(n) ? "true" : "false",
        dataset: { node: node.id } },
        `${node.name} (${node.devices.length} devices${node.maintenance ? ", maintenance" : ""}${node.healthy ? "" : ", unhealthy"})`);
      button.addEventListener("click", () => {
        drawn.toggle(n);
        button.setAttribute("aria-expanded", drawn.isExpanded(n) ? "true" : "false");
      });
      return button;
    }));
    const unhealthy = tl.nodes.reduce((k, node) => k + node.devices.filter((d) => !d.healthy).length, 0);
    fill(status, `${tl.nodes.length} nodes · ${tl.bookings.length} bookings shown · horizon `, time(tl.pool.horizon),
      unhealthy ? ` · ${unhealthy} unhealthy devices` : "");
  }

  function zooms() {
    const spans = [["6 hours", 6 * 3600e3], ["Day", 86400e3], ["Week", 7 * 86400e3], ["All", null]];
    fill(zoomButtons, spans.map(([label, span]) => h("button", { type: "button", onclick: () => {
      if (!drawn) return;
      if (span === null) drawn.zoomTo(tl.from, tl.to);
      else drawn.zoomTo(Math.max(tl.from, tl.now - span / 4), Math.min(tl.to, tl.now + (span * 3) / 4));
    } }, label)),
    h("button", { type: "button", "aria-label": "Earlier", onclick: () => pan(-1) }, "◀"),
    h("button", { type: "button", "aria-label": "Later", onclick: () => pan(1) }, "▶"));
  }

  function pan(direction) {
    const [a, b] = drawn.span();
    const step = ((b - a) / 2) * direction;
    const start = Math.min(Math.max(tl.from, a + step), tl.to - (b - a));
    drawn.zoomTo(start, start + (b - a));
  }

  let complete = false;

  function show(next) {
    tl = next;
    if (drawn) drawn.update(tl);
    else {
      drawn = drawTimeline(chartBox, tl, {
        onOpen: (r) => { location.hash = `#/reservations/${encodeURIComponent(r.id)}`; },
        onDrawn: () => markDrawn(chartBox, tl),
        onPickWindow,
      });
      zooms();
    }
    chartBox.dataset.bookings = String(tl.bookings.length);
    lists();
    if (!complete) status.append(" · loading the rest of the horizon…");
  }

  /**
   * The first load draws the part on screen first (firstTimeline), then the whole span from
   * the past day to the horizon; later loads (live updates) read the whole span.
   */
  async function load() {
    if (!drawn) {
      const pre = session.prefetch;
      session.prefetch = null;
      const [first] = await Promise.all([pre && pre.poolId === poolId ? pre.answer : firstTimeline(poolId), charts()]);
      if (!chartBox.isConnected) return;
      show(first);
    }
    const whole = await api("pools/timeline", { poolId });
    if (!chartBox.isConnected) return;
    complete = true;
    show(whole);
    if (!document.body.dataset.timelineComplete) {
      if (!performance.getEntriesByName("timeline-complete").length) performance.mark("timeline-complete");
      document.body.dataset.timelineComplete = "1";
    }
  }

  return {
    element: panel,
    load,
    get data() { return tl; },
    highlight(windows) { if (drawn) drawn.setHighlights(windows); },
    zoomTo(a, b) { if (drawn) drawn.zoomTo(a, b); },
    dispose() { if (drawn) drawn.dispose(); },
  };
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function colourTag(r) {
  const key = r.spot ? "spot" : r.state;
  const swatch = h("span", { class: "swatch", title: r.state });
  swatch.style.background = PALETTE[key] || PALETTE.busy;
  return swatch;
}

export async function timelineView(main, session, poolArg) {
  if (session.pools && !session.pools.length) {
    fill(main, h("h1", {}, "Timeline"), noPools());
    return null;
  }
  // Without the pools yet (app.js lets a named pool's timeline go first): that pool, and the
  // picker when they come.
  const poolId = !session.pools || session.pools.some((p) => p.poolId === poolArg)
    ? poolArg : session.pools[0].poolId;
  const panel = timelinePanel(session, poolId);
  const error = h("div", { id: "timeline-error" });
  const picker = h("span", {});
  const choose = (id) => { location.hash = `#/timeline/${encodeURIComponent(id)}`; };
  if (session.pools) fill(picker, poolPicker(session, poolId, choose));
  else session.poolsReady.then(() => fill(picker, poolPicker(session, poolId, choose)), () => {});
  fill(main, h("div", { class: "view-head" }, h("h1", {}, "Timeline"), picker), error, panel.element);
  try {
    await panel.load();
  } catch (e) {
    fill(error, errorBox(e, "Loading the timeline"));
  }
  return {
    refresh: async () => { await panel.load(); fill(error); },
    dispose: () => panel.dispose(),
  };
}

function numberField(id, label, attrs = {}) {
  const input = h("input", { id, name: id, type: "number", inputmode: "numeric", ...attrs });
  return { input, field: h("label", { class: "field", for: id }, label, " ", input) };
}

/**
 * Whether the caller may book this pool with binding "kubernetes" (only a pool its tenant
 * owns whose policy allows it): the server says, to a preview of one device of the pool's
 * kind with that binding, which it refuses naming the field "binding" otherwise.
 */
async function kubernetesAllowed(session, poolId, tl) {
  const device = tl && tl.nodes.flatMap((n) => n.devices)[0];
  if (!device) return false;
  const ask = { class: device.kind, count: 1 };
  if (device.kind === "mig") {
    const profile = /· (\S+) #/.exec(device.label);
    if (!profile) return false;
    ask.profile = profile[1];
  }
  try {
    await api("capacity/preview", { tenantId: session.me.tenantId, poolId, devices: [ask],
      duration: "1h", binding: "kubernetes" });
    return true;
  } catch {
    return false;
  }
}

export async function findView(main, session, poolArg) {
  if (!session.pools.length) {
    fill(main, h("h1", {}, "Find a window"), noPools());
    return null;
  }
  let poolId = session.pools.some((p) => p.poolId === poolArg) ? poolArg : session.pools[0].poolId;
  const count = numberField("count", "GPUs", { min: 1, max: 1024, value: 1, required: true });
  const klass = h("select", { id: "class", name: "class" },
    h("option", { value: "gpu" }, "whole GPU"), h("option", { value: "mig" }, "MIG instance"),
    h("option", { value: "slot" }, "shared slot"));
  const profile = h("input", { id: "profile", name: "profile", placeholder: "1g.10gb", spellcheck: "false" });
  const profileField = h("label", { class: "field", for: "profile", hidden: true }, "MIG profile ", profile);
  const topology = h("select", { id: "topology", name: "topology" },
    h("option", { value: "any" }, "any"), h("option", { value: "nvlink-all" }, "all on one NVLink domain"));
  const length = h("input", { id: "duration", name: "duration", value: "8h", required: true,
    spellcheck: "false", "aria-describedby": "duration-help" });
  const vcpu = numberField("vcpu", "Host CPUs (optional)", { min: 0, max: 4096 });
  const memory = numberField("memory", "Host memory GiB (optional)", { min: 0, max: 65536 });
  const kubernetes = h("input", { id: "kubernetes", name: "kubernetes", type: "checkbox" });
  const kubeField = h("label", { class: "field check", for: "kubernetes", hidden: true }, kubernetes,
    " Use from Kubernetes pods (binding: kubernetes)");
  const poolField = poolPicker(session, poolId, (id) => { poolId = id; reloadPool(); });
  klass.addEventListener("change", () => { profileField.hidden = klass.value !== "mig"; });
  const form = h("form", { class: "find-form", id: "find-form" },
    poolField, count.field, h("label", { class: "field", for: "class" }, "Kind ", klass), profileField,
    h("label", { class: "field", for: "topology" }, "Topology ", topology),
    h("label", { class: "field", for: "duration" }, "For ", length),
    h("span", { id: "duration-help", class: "muted" }, "e.g. 8h, 90m, 2d"),
    vcpu.field, memory.field, kubeField,
    h("button", { type: "submit" }, "Find the earliest windows"));
  const results = h("div", { id: "windows", "aria-live": "polite" });
  const booking = h("div", { id: "booking" });
  let panel = null;
  const panelBox = h("div", {});
  fill(main, h("h1", {}, "Find a window"),
    h("p", { class: "muted" }, "Say what you need; the earliest windows it fits are listed and drawn on the pool's timeline. Nothing is booked until you reserve."),
    form, results, booking, panelBox);

  function request() {
    const device = { class: klass.value, count: Number(count.input.value), topology: topology.value };
    if (klass.value === "mig" && profile.value.trim()) device.profile = profile.value.trim();
    const body = { tenantId: session.me.tenantId, poolId, devices: [device], duration: length.value.trim() };
    const resources = {};
    if (vcpu.input.value !== "") resources.vcpu = Number(vcpu.input.value);
    if (memory.input.value !== "") resources.memoryGiB = Number(memory.input.value);
    if (Object.keys(resources).length) body.resources = resources;
    if (!kubeField.hidden && kubernetes.checked) body.binding = "kubernetes";
    return body;
  }

  async function reloadPool() {
    if (panel) panel.dispose();
    panel = timelinePanel(session, poolId, { onPickWindow: (value) => {
      const w = lastWindows.find((x) => x.start === value[1]);
      if (w) pick(w, lastRequest);
    } });
    fill(panelBox, h("h2", {}, "The pool's timeline"), panel.element);
    fill(results);
    fill(booking);
    kubeField.hidden = true;
    kubernetes.checked = false;
    try {
      await panel.load();
    } catch (e) {
      fill(panelBox, errorBox(e, "Loading the timeline"));
      return;
    }
    const asked = poolId;
    const allowed = await kubernetesAllowed(session, poolId, panel.data);
    if (asked === poolId) kubeField.hidden = !allowed;
  }

  let lastWindows = [];
  let lastRequest = null;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    fill(booking);
    const body = request();
    lastRequest = body;
    fill(results, h("p", { class: "loading" }, "Searching…"));
    try {
      const found = await api("capacity/search", { ...body, limit: 5 });
      lastWindows = found.windows;
      if (!found.windows.length) {
        fill(results, h("div", { class: "empty" }, h("strong", {}, found.never ? "It never fits this pool. " : "No window in the search horizon. "),
          found.message, h("br"), h("span", { class: "muted" }, found.never
            ? "Ask for fewer devices, another topology, or another pool."
            : "Try a shorter duration or fewer devices.")));
        panel.highlight([]);
        return;
      }
      fill(results, h("h2", {}, "Earliest windows"), h("ol", { class: "windows" }, found.windows.map((w, i) =>
        h("li", {}, time(w.start), " → ", time(w.end), ` · on ${w.nodeIds.join(", ")} `,
          h("button", { type: "button", dataset: { window: String(i) }, onclick: () => pick(w, body) }, "Pick this window")))));
      panel.highlight(found.windows);
      panel.zoomTo(found.windows[0].start - 3 * 3600e3, found.windows[found.windows.length - 1].end + 3 * 3600e3);
    } catch (e) {
      fill(results, errorBox(e, "The search"));
    }
  });

  function pick(w, body) {
    const key = newKey("console");
    // A window that opens now is booked from now (a start already past by the click would
    // ask for a window partly gone). The body is fixed here: a retry sends it unchanged.
    const createBody = { ...body, idempotencyKey: key };
    if (w.start > Date.now() + 60e3) createBody.start = w.start;
    const outcome = h("div", { id: "booking-outcome", "aria-live": "polite" });
    const reserve = h("button", { type: "button", id: "reserve", class: "primary" }, "Reserve");
    reserve.addEventListener("click", async () => {
      reserve.disabled = true;
      fill(outcome, h("p", { class: "loading" }, "Reserving…"));
      try {
        const made = await api("reservations/create", createBody);
        fill(outcome, h("p", { class: "ok" }, `Reserved: ${made.id} (${made.state}). `,
          h("a", { href: `#/reservations/${encodeURIComponent(made.id)}` }, "Open it")));
        notice(`Reserved ${made.id}`);
        panel.highlight([]);
        await panel.load();
      } catch (e) {
        fill(outcome, errorBox(e, "The reservation"),
          h("p", { class: "muted" }, "Retrying sends the same key: it never books twice."));
        reserve.textContent = "Retry with the same key";
        reserve.disabled = false;
      }
    });
    fill(booking, h("section", { class: "card" }, h("h2", {}, "Reserve this window"),
      h("p", {}, `${body.devices[0].count} × ${body.devices[0].class} on ${body.poolId} for ${duration(w.end - w.start)}: `,
        time(w.start), " → ", time(w.end)),
      h("p", {}, "Idempotency key: ", h("code", { id: "idempotency-key" }, key),
        h("span", { class: "muted" }, " — a retry with this key is safe: it never books twice.")),
      reserve, outcome));
    reserve.focus();
  }

  await reloadPool();
  return {
    refresh: async () => { if (panel) await panel.load(); },
    dispose: () => { if (panel) panel.dispose(); },
  };
}
