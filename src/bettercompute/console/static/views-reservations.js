// Reservations: a filterable list (state, pool, label or key) and one reservation's page
// (state history, conditions, events, bound nodes and devices, host resources, lease) with
// extend / renew / release / cancel, each asked about first as the CLI's help describes them.

import { PALETTE, api, activatable, confirmAction, describeDevices, errorBox, fill, h, newKey, notice, time, duration } from "./lib.js";

const STATES = ["awaiting-confirmation", "pending", "placed", "binding", "active", "releasing",
  "released", "failed", "cancelled", "expired", "denied"];
const LIVE = new Set(["pending", "placed", "binding", "active", "awaiting-confirmation"]);

function stateTag(state) {
  const tag = h("span", { class: `state-tag state-${state}` }, state);
  if (PALETTE[state]) tag.style.borderColor = PALETTE[state];
  return tag;
}

function labelsOf(r) {
  return r.labels || (r.request && r.request.labels) || {};
}

/** Whether a reservation matches the label filter: "key=value", "key", or text in its key. */
function matches(r, filter) {
  if (!filter) return true;
  const labels = labelsOf(r);
  const [k, v] = filter.split("=", 2);
  if (v !== undefined) return labels[k.trim()] === v.trim();
  if (Object.prototype.hasOwnProperty.call(labels, filter)) return true;
  const text = filter.toLowerCase();
  return [r.id, r.idempotencyKey, r.request && r.request.projectId]
    .some((s) => typeof s === "string" && s.toLowerCase().includes(text));
}

export async function reservationsView(main, session) {
  const stateSelect = h("select", { id: "filter-state" }, h("option", { value: "" }, "any state"),
    STATES.map((s) => h("option", { value: s }, s)));
  const poolSelect = h("select", { id: "filter-pool" }, h("option", { value: "" }, "any pool"),
    session.pools.map((p) => h("option", { value: p.poolId }, p.poolId)));
  const labelInput = h("input", { id: "filter-label", placeholder: "team=vision, or part of a key", spellcheck: "false" });
  const body = h("tbody", {});
  const more = h("button", { type: "button", id: "more", hidden: true }, "Load more");
  const message = h("div", { id: "list-message" });
  let items = [];
  let cursor = null;
  let scope = "all";

  fill(main, h("h1", {}, "Reservations"),
    h("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); reload(); } },
      h("label", { class: "field", for: "filter-state" }, "State ", stateSelect),
      h("label", { class: "field", for: "filter-pool" }, "Pool ", poolSelect),
      h("label", { class: "field", for: "filter-label" }, "Label or key ", labelInput),
      h("button", { type: "submit" }, "Filter")),
    message,
    h("table", { class: "list", id: "reservations" },
      h("thead", {}, h("tr", {}, ["Reservation", "State", "Pool", "Devices", "Start", "End"].map((c) => h("th", { scope: "col" }, c)))),
      body),
    more);
  stateSelect.addEventListener("change", reload);
  poolSelect.addEventListener("change", reload);
  more.addEventListener("click", () => page(false));

  async function page(first) {
    const request = { tenantId: session.me.tenantId, scope, limit: 100 };
    if (stateSelect.value) request.state = stateSelect.value;
    if (poolSelect.value) request.poolId = poolSelect.value;
    if (!first && cursor) request.cursor = cursor;
    let answer;
    try {
      answer = await api("reservations/list", request);
    } catch (e) {
      if (scope === "all" && e.code === "ACCESS_DENIED") {
        scope = "mine"; // Only the tenant's admins list everyone's: show one's own.
        return page(first);
      }
      fill(message, errorBox(e, "Listing reservations"));
      return;
    }
    fill(message);
    items = first ? answer.items : items.concat(answer.items);
    cursor = answer.nextCursor;
    more.hidden = !cursor;
    draw();
  }

  function draw() {
    const shown = items.filter((r) => matches(r, labelInput.value.trim()));
    fill(body, shown.map((r) => activatable(h("tr", { dataset: { id: r.id } },
      h("td", {}, h("span", { class: "name" }, r.idempotencyKey), h("br"), h("code", { class: "muted" }, r.id)),
      h("td", {}, stateTag(r.state)), h("td", {}, r.poolId), h("td", {}, describeDevices(r.request)),
      h("td", {}, time(r.during ? r.during.start : r.requestedStart)), h("td", {}, time(r.during && r.during.end))),
    () => { location.hash = `#/reservations/${encodeURIComponent(r.id)}`; }, `Open ${r.idempotencyKey} (${r.id})`)));
    if (!shown.length) {
      fill(message, h("div", { class: "empty" }, "No reservations match. Clear the filters, or book one in ",
        h("a", { href: "#/find" }, "Find a window"), "."));
    }
  }

  async function reload() { cursor = null; await page(true); }
  labelInput.addEventListener("input", draw);
  await reload();
  return { refresh: reload };
}

function row(term, ...value) {
  return [h("dt", {}, term), h("dd", {}, ...value)];
}

function hostResources(r) {
  const resources = (r.request && r.request.resources) || {};
  const parts = Object.entries(resources).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`);
  const share = Object.entries(r.hostShare || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`);
  return (parts.join(", ") || "none asked") + (share.length ? ` (pool's per-GPU share: ${share.join(", ")})` : "");
}

function historyStrip(items) {
  if (!items.length) return h("p", { class: "muted" }, "No transitions recorded yet.");
  return h("ol", { class: "history", id: "history" }, items.map((t) => h("li", {},
    stateTag(t.to), h("br"), time(Date.parse(t.at)),
    t.reason ? h("div", { class: "muted" }, t.reason) : null,
    t.actor ? h("div", { class: "muted" }, `by ${t.actor}`) : null)));
}

export async function reservationView(main, session, id) {
  const box = h("div", {});
  // Kept across reloads of the page's facts: what the last action answered stays in view.
  const outcome = h("div", { id: "action-outcome", "aria-live": "polite" });
  fill(main, h("p", {}, h("a", { href: "#/reservations" }, "← All reservations")), box);

  async function load() {
    let r;
    try {
      r = await api("reservations/get", { tenantId: session.me.tenantId, reservationId: id });
    } catch (e) {
      fill(box, errorBox(e, `Reading ${id}`));
      return;
    }
    let history = null;
    try {
      history = await api("reservations/history", { id });
    } catch {
      history = null; // An older server without the history: the page shows the rest.
    }
    const binding = r.binding || {};
    const actions = h("div", { class: "actions", id: "actions" });
    fill(box,
      h("div", { class: "view-head" }, h("h1", {}, h("span", { class: "name" }, r.idempotencyKey)), stateTag(r.state)),
      h("dl", { class: "facts" },
        row("id", h("code", {}, r.id)), row("key", h("code", {}, r.idempotencyKey)),
        row("pool", r.poolId), row("devices", describeDevices(r.request)),
        row("window", r.during ? [time(r.during.start), " → ", time(r.during.end), ` (${duration(r.during.end - r.during.start)})`] : "not placed yet"),
        r.requestedStart ? row("requested start", time(r.requestedStart)) : [],
        row("host resources", hostResources(r)),
        row("lease", r.leaseExpiresAt ? ["runs out ", time(r.leaseExpiresAt)] : "none (no leaseSeconds)"),
        row("binding", String((r.request && r.request.binding) || "hold")),
        row("nodes", (binding.nodeIds || []).join(", ") || "none bound yet"),
        row("devices bound", (binding.cdiDevices || []).length
          ? h("ul", { class: "plain" }, binding.cdiDevices.map((d) => h("li", {}, h("code", {}, d)))) : "none yet"),
        "attested" in binding ? row("attested", binding.attested ? "yes" : "no") : [],
        r.resourceName ? row("pod resource", h("code", {}, r.resourceName)) : [],
        row("owner", r.ownerIdentityId), row("created", time(r.createdAt)),
        r.releaseReason ? row("released because", r.releaseReason) : []),
      h("h2", {}, "Actions"), actions, outcome,
      h("h2", {}, "State history"), historyStrip(history ? history.items : []),
      h("h2", {}, "Conditions"),
      r.conditions.length ? h("table", { class: "list", id: "conditions" },
        h("thead", {}, h("tr", {}, ["Type", "Status", "Reason", "Message", "Since"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, r.conditions.map((c) => h("tr", {}, h("td", {}, c.type), h("td", {}, String(c.status ?? "")),
          h("td", {}, c.reason || ""), h("td", {}, c.message || ""),
          h("td", {}, c.lastTransitionTime ? time(c.lastTransitionTime) : ""))))) : h("p", { class: "muted" }, "No conditions."),
      h("h2", {}, "Events"),
      history && history.events.length ? h("ul", { class: "plain", id: "events" }, history.events.map((e) =>
        h("li", {}, time(Date.parse(e.at)), " ", h("code", {}, e.type), e.message ? ` — ${e.message}` : "")))
        : h("p", { class: "muted" }, "No events yet."));
    drawActions(r, actions, outcome);
  }

  function drawActions(r, actions, outcome) {
    const buttons = [];
    const act = async (operation, body, done) => {
      fill(outcome, h("p", { class: "loading" }, "Working…"));
      try {
        const answer = await api(`reservations/${operation}`, body);
        fill(outcome, h("p", { class: "ok" }, done(answer)));
        notice(done(answer));
        await load();
      } catch (e) {
        fill(outcome, errorBox(e, operation));
      }
    };
    const base = { tenantId: session.me.tenantId, reservationId: r.id };
    if (["placed", "binding", "active"].includes(r.state) && r.during) {
      const by = h("input", { id: "extend-by", value: "4h", size: 6, spellcheck: "false" });
      const key = newKey("console-ext");
      buttons.push(h("span", { class: "inline" }, h("label", { for: "extend-by" }, "Extend by "), by,
        h("button", { type: "button", id: "extend", onclick: async () => {
          if (await confirmAction("Extend this reservation?",
            `Move its end later by ${by.value}, decided by policy like a create. Key: ${key} (a retry with it is safe).`, "Extend")) {
            act("extend", { ...base, by: by.value.trim(), idempotencyKey: key }, (a) => a.extended
              ? `Extended: now ends ${new Date(a.reservation.during.end).toLocaleString()}`
              : `Not extended: another booking starts first${a.availableUntil ? ` (free until ${new Date(a.availableUntil).toLocaleString()})` : ""}.`);
          }
        } }, "Extend")));
    }
    if (r.leaseExpiresAt && LIVE.has(r.state)) {
      buttons.push(h("button", { type: "button", id: "renew", onclick: async () => {
        if (await confirmAction("Renew the lease?", "The lease then runs out its leaseSeconds from now.", "Renew")) {
          act("renew", base, () => "Lease renewed.");
        }
      } }, "Renew lease"));
    }
    if (["placed", "binding", "active", "pending"].includes(r.state)) {
      buttons.push(h("button", { type: "button", id: "release", class: "danger", onclick: async () => {
        if (await confirmAction(`Release ${r.idempotencyKey}?`,
          "End it now: future bookings go, quota is refunded, billing stops. This cannot be undone.", "Release")) {
          act("release", base, (a) => `Released: ${a.id} is ${a.state}.`);
        }
      } }, "Release"));
    }
    if (["pending", "placed"].includes(r.state)) {
      buttons.push(h("button", { type: "button", id: "cancel", onclick: async () => {
        if (await confirmAction(`Cancel ${r.idempotencyKey}?`,
          "Withdraw it before it starts: its booking goes and its quota is refunded.", "Cancel it")) {
          act("cancel", base, (a) => `Cancelled: ${a.id} is ${a.state}.`);
        }
      } }, "Cancel"));
    }
    fill(actions, buttons.length ? buttons : h("p", { class: "muted" }, `Nothing to do: it is ${r.state}.`));
  }

  await load();
  return {
    // Not while the person is typing in it (the "Extend by" field): the next event will do.
    refresh: async () => {
      const typing = document.activeElement && document.activeElement.tagName === "INPUT";
      if (!(typing && box.contains(document.activeElement))) await load();
    },
  };
}
