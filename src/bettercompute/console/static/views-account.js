// Quota & usage (per resource charged / limit / left as gauges, GPU-hours by day and pool
// as a stacked bar chart) and the Confirmations inbox (what agents acting for me wait on).

import { PALETTE, api, charts, describeDevices, errorBox, fill, h, notice, time, duration } from "./lib.js";

const DAY = 86400e3;
const SERIES_COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"];

function gauge(container, row) {
  const chart = window.echarts.init(container);
  const max = Math.max(row.limit, row.used, 1);
  chart.setOption({
    animation: false,
    series: [{ type: "gauge", min: 0, max, startAngle: 200, endAngle: -20, radius: "95%",
      progress: { show: true, width: 12, itemStyle: { color: row.used > row.limit ? PALETTE.spot : PALETTE.pending } },
      axisLine: { lineStyle: { width: 12, color: [[1, "#e6e6e6"]] } },
      axisTick: { show: false }, splitLine: { show: false }, axisLabel: { show: false }, pointer: { show: false },
      detail: { valueAnimation: false, offsetCenter: [0, "10%"], fontSize: 18, formatter: `{value} / ${row.limit}` },
      data: [{ value: row.used }] }],
  });
  return chart;
}

export async function quotaView(main, session) {
  const gauges = h("div", { class: "gauges", id: "quota" });
  const chartBox = h("div", { class: "chart usage", id: "usage-chart", role: "img",
    "aria-label": "GPU-hours billed per day, stacked by pool" });
  const usageTable = h("div", { id: "usage-table" });
  const error = h("div", {});
  fill(main, h("h1", {}, "Quota & usage"), error,
    h("h2", {}, "Quota"), h("p", { class: "muted" }, "What live reservations charge now against each limit. A resource not listed grants nothing."),
    gauges, h("h2", {}, "GPU-hours, last 14 days, by pool"), chartBox, usageTable);
  let gaugeCharts = [];
  let usage = null;

  async function load() {
    const tenantId = session.me.tenantId;
    try {
      await charts();
    } catch (e) {
      fill(error, errorBox(e, "Loading the charts"));
      return;
    }
    let quotas;
    try {
      quotas = await api("quotas/get", { tenantId });
    } catch (e) {
      fill(error, errorBox(e, "Reading the quota"));
      return;
    }
    fill(error);
    for (const c of gaugeCharts) c.dispose();
    gaugeCharts = [];
    fill(gauges, quotas.quotas.length ? quotas.quotas.map((row) => {
      const box = h("div", { class: "gauge-chart", role: "img",
        "aria-label": `${row.resource}: ${row.used} of ${row.limit} charged` });
      const left = row.limit - row.used;
      const card = h("div", { class: "gauge", dataset: { resource: row.resource } },
        h("h3", {}, row.resource), box,
        h("p", { class: "figures" }, h("span", { class: "used" }, `charged ${row.used}`), ` · limit ${row.limit} · `,
          h("strong", { class: left < 0 ? "bad" : "" }, left < 0 ? `${-left} over` : `${left} left`)));
      requestAnimationFrame(() => { if (box.isConnected) gaugeCharts.push(gauge(box, row)); });
      return card;
    }) : h("p", { class: "empty" }, "No quota rows: this tenant may book nothing. Ask your platform team for a quota."));

    // One usage report per day, each by pool: the API groups by one dimension at a time.
    const today = Math.floor(Date.now() / DAY) * DAY;
    const days = Array.from({ length: 14 }, (_, i) => today - (13 - i) * DAY);
    let reports;
    try {
      reports = await Promise.all(days.map((day) => api("usage/report",
        { tenantId, from: day, to: Math.min(day + DAY, Date.now()), by: "pool" })));
    } catch (e) {
      fill(usageTable, errorBox(e, "Reading the usage"));
      return;
    }
    const pools = [...new Set(reports.flatMap((r) => r.items.map((i) => i.poolId)))].sort();
    const total = reports.reduce((n, r) => n + r.total.gpuHours, 0);
    fill(usageTable, h("p", {}, `${total.toFixed(2)} GPU-hours billed in the last 14 days`,
      pools.length ? ` across ${pools.join(", ")}.` : ". Nothing billed yet: usage counts from a reservation's bind to its release."));
    if (usage) usage.dispose();
    usage = window.echarts.init(chartBox);
    usage.setOption({
      animation: false, color: SERIES_COLOURS,
      tooltip: { trigger: "axis", valueFormatter: (v) => `${Number(v).toFixed(2)} GPU-h` },
      legend: { top: 0 },
      grid: { left: 56, right: 16, top: 36, bottom: 40 },
      xAxis: { type: "category", data: days.map((d) => new Date(d).toLocaleDateString(undefined, { month: "short", day: "numeric" })) },
      yAxis: { type: "value", name: "GPU-hours" },
      graphic: pools.length ? [] : [{ type: "text", left: "center", top: "middle",
        style: { text: "No GPU-hours billed in these 14 days", fill: "#5a5a5a", fontSize: 14 } }],
      series: pools.map((pool) => ({ name: pool, type: "bar", stack: "pools",
        data: reports.map((r) => { const item = r.items.find((i) => i.poolId === pool); return item ? +item.gpuHours.toFixed(3) : 0; }) })),
    });
  }

  await load();
  return {
    refresh: load,
    dispose: () => { for (const c of gaugeCharts) c.dispose(); if (usage) usage.dispose(); },
  };
}

/** A stored duration (milliseconds, "7200000ms" or "2h30m") as "2h 30m". */
function durationText(value) {
  if (typeof value === "number") return duration(value);
  const ms = /^(\d+)ms$/.exec(String(value));
  return ms ? duration(Number(ms[1])) : String(value);
}

function describeRequest(request) {
  const parts = [describeDevices(request)];
  if (request && request.poolId) parts.push(`on ${request.poolId}`);
  if (request && request.duration) parts.push(`for ${durationText(request.duration)}`);
  return parts.join(" ");
}

export async function confirmationsView(main, session) {
  const waiting = h("div", { id: "confirmations-pending" });
  const decided = h("div", { id: "confirmations-decided" });
  fill(main, h("h1", {}, "Confirmations"),
    h("p", { class: "muted" }, "What agents acting for you asked and a policy holds for your yes. Approving lets the agent's retry with the same key go ahead; denying denies the reservation."),
    h("h2", {}, "Waiting for you"), waiting, h("h2", {}, "Decided and asked by you"), decided);

  async function decide(c, verb) {
    try {
      await api(`confirmations/${verb}`, { tenantId: session.me.tenantId, confirmationId: c.id });
      notice(`${verb === "approve" ? "Approved" : "Denied"} ${c.id}`);
    } catch (e) {
      notice(`${verb} failed: ${e.message}`, "bad");
    }
    await load();
  }

  async function load() {
    let list;
    try {
      list = await api("confirmations/list", { tenantId: session.me.tenantId, limit: 100 });
    } catch (e) {
      fill(waiting, errorBox(e, "Listing confirmations"));
      return;
    }
    const mine = list.items.filter((c) => c.state === "pending" && c.personId === session.me.identityId);
    const rest = list.items.filter((c) => !mine.includes(c));
    fill(waiting, mine.length ? h("ul", { class: "cards" }, mine.map((c) => h("li", { class: "card", dataset: { id: c.id } },
      h("h3", {}, `${c.agentId} asks: ${describeRequest(c.request)}`),
      h("p", {}, h("code", {}, c.id), " · reservation ", h("a", { href: `#/reservations/${encodeURIComponent(c.reservationId)}` }, c.reservationId),
        " · ", c.action),
      h("p", { class: "muted" }, "asked ", time(c.createdAt), " · expires ", time(c.expiresAt)),
      h("div", { class: "actions" },
        h("button", { type: "button", class: "primary approve", onclick: () => decide(c, "approve") }, "Approve"),
        h("button", { type: "button", class: "danger deny", onclick: () => decide(c, "deny") }, "Deny")))))
      : h("p", { class: "empty" }, "Nothing waits for you. When an agent acting for you asks for more than a policy lets it do alone, it appears here."));
    fill(decided, rest.length ? h("table", { class: "list" },
      h("thead", {}, h("tr", {}, ["Confirmation", "State", "Agent", "Person", "What", "Decided"].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, rest.map((c) => h("tr", { dataset: { id: c.id } }, h("td", {}, h("code", {}, c.id)), h("td", {}, c.state),
        h("td", {}, c.agentId), h("td", {}, c.personId), h("td", {}, describeRequest(c.request)),
        h("td", {}, c.decidedAt ? [time(c.decidedAt), ` by ${c.decidedBy}`] : "—")))))
      : h("p", { class: "muted" }, "None."));
  }

  await load();
  return { refresh: load };
}
