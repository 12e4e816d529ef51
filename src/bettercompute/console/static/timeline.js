// The pool timeline: one ECharts chart (canvas) whose rows are a pool's nodes, each
// expandable to its devices, and whose bars are the bookings the server's pools/timeline
// answered. A node row splits its height into one thin lane per device, so bookings on
// different devices of one node never hide each other. The chart only ever sees what the
// server sent: another tenant's bookings arrive as "busy" with no id, name or key.
// Tooltips are built as DOM with text nodes, never HTML strings, so names stay text.

import { PALETTE, h, localText, utc, duration } from "./lib.js";

const ROW_PX = 24;
const VISIBLE_ROWS = 22;

/** The colour of a state code, by the name the answer's `states` gives it. */
function colourOf(states, code) {
  return PALETTE[states[code]] || PALETTE.busy;
}

function heightFor(rows) {
  return `${Math.min(rows, VISIBLE_ROWS) * ROW_PX + 110}px`;
}

/** Rows: every node, and under an expanded node its devices. */
function buildRows(tl, expanded) {
  const rows = [];
  const nodeRow = [];
  const deviceRow = [];
  tl.nodes.forEach((node, n) => {
    nodeRow[n] = rows.length;
    let label = node.name;
    if (node.maintenance) label += " · maintenance";
    if (!node.healthy) label += " · unhealthy";
    rows.push({ kind: "node", node: n, label: (expanded.has(n) ? "▾ " : "▸ ") + label,
      bad: node.maintenance ? "maintenance" : node.healthy ? null : "unhealthy" });
    deviceRow[n] = [];
    if (expanded.has(n)) {
      node.devices.forEach((device, d) => {
        deviceRow[n][d] = rows.length;
        rows.push({ kind: "device", node: n, device: d,
          label: "    " + device.label + (device.healthy ? "" : " · unhealthy"),
          bad: device.healthy ? null : "unhealthy" });
      });
    }
  });
  return { rows, nodeRow, deviceRow };
}

/** Contiguous runs of device indices: [0,1,2,5] → [[0,3],[5,1]] (start, length). */
function runs(indices) {
  const sorted = [...indices].sort((a, b) => a - b);
  const out = [];
  for (const i of sorted) {
    const last = out[out.length - 1];
    if (last && last[0] + last[1] === i) last[1] += 1;
    else out.push([i, 1]);
  }
  return out;
}

/** Bar items: [row, start, end, stateCode, ref, topFraction, heightFraction]. */
function buildBars(tl, layout) {
  const items = [];
  for (const [n, devices, start, end, code, ref] of tl.bookings) {
    const node = tl.nodes[n];
    if (!node) continue;
    const lanes = Math.max(node.devices.length, 1);
    for (const [first, count] of runs(devices)) {
      items.push([layout.nodeRow[n], start, end, code, ref ?? -1, first / lanes, count / lanes]);
    }
    const rowsOfDevices = layout.deviceRow[n];
    if (rowsOfDevices && rowsOfDevices.length) {
      for (const d of devices) {
        if (rowsOfDevices[d] !== undefined) items.push([rowsOfDevices[d], start, end, code, ref ?? -1, 0, 1]);
      }
    }
  }
  return items;
}

function tooltipFor(tl, item) {
  const [, start, end, code, ref] = item;
  const when = h("div", {}, `${localText(start)} → ${localText(end)} (${duration(end - start)})`);
  const inUtc = h("div", { class: "muted" }, `${utc(start)} → ${utc(end)}`);
  if (ref < 0) {
    return h("div", { class: "tip" }, h("strong", {}, "Busy"),
      h("div", {}, "Booked by someone else."), when, inUtc);
  }
  const r = tl.reservations[ref] || {};
  return h("div", { class: "tip" }, h("strong", {}, r.name || r.id || "reservation"),
    h("div", {}, `${r.state || tl.states[code]}${r.spot ? " · spot" : ""} · ${r.gpus ?? "?"} device${r.gpus === 1 ? "" : "s"}`),
    when, inUtc, h("div", { class: "muted" }, `${r.id || ""} · click to open`));
}

/**
 * Draw `tl` (a pools/timeline answer) into `container`. Options: onOpen(reservation) when an
 * own bar is clicked; onDrawn() once, after the first frame is drawn. Returns a controller.
 */
export function drawTimeline(container, tl, options = {}) {
  const echarts = window.echarts; // loaded by the caller (lib.charts)
  const expanded = new Set();
  let highlights = [];
  let layout = null;
  let data = tl;
  // The height first: init measures the container, and a resize later would draw twice.
  container.style.height = heightFor(buildRows(data, expanded).rows.length);
  const chart = echarts.init(container, null, { renderer: "canvas" });
  let drawnOnce = false;
  chart.on("finished", () => {
    if (!drawnOnce) {
      drawnOnce = true;
      if (options.onDrawn) options.onDrawn();
    }
  });

  function highlightItems() {
    const out = [];
    const index = new Map(data.nodes.map((node, i) => [node.id, i]));
    for (const w of highlights) {
      for (const id of w.nodeIds || []) {
        const n = index.get(id);
        if (n !== undefined) out.push([layout.nodeRow[n], w.start, w.end]);
      }
    }
    return out;
  }

  function option(keepZoom) {
    layout = buildRows(data, expanded);
    const rows = layout.rows;
    const bars = buildBars(data, layout);
    // Full-width bands behind unhealthy and maintenance rows: [row, from, to, 1 | 2].
    const bands = rows.map((row, i) => [i, data.from, data.to, row.bad === "maintenance" ? 2 : row.bad ? 1 : 0])
      .filter((b) => b[3]);
    const viewStart = Math.max(data.from, data.now - 6 * 3600e3);
    const viewEnd = Math.min(data.to, data.now + 3 * 86400e3);
    const zoomX = keepZoom || { startValue: viewStart, endValue: viewEnd };
    // The rows in view: as many as fit (VISIBLE_ROWS), from the first one in view before (a
    // node opened or closed changes how many rows there are, not where the reader is).
    const shownRows = Math.min(rows.length, VISIBLE_ROWS);
    const firstRow = keepZoom && keepZoom.rows
      ? Math.max(0, Math.min(Number(keepZoom.rows.startValue) || 0, rows.length - shownRows)) : 0;
    const zoomY = { startValue: firstRow, endValue: firstRow + shownRows - 1 };
    container.style.height = heightFor(rows.length);
    return {
      animation: false,
      aria: { enabled: true, label: { description:
        `Timeline of pool ${data.pool.name}: ${data.nodes.length} nodes, ${data.bookings.length} bookings.` } },
      grid: { left: 190, right: 56, top: 16, bottom: 64 },
      tooltip: {
        trigger: "item", confine: true, enterable: false,
        formatter: (p) => (p.seriesId === "bars" ? tooltipFor(data, p.value)
          : p.seriesId === "windows" ? h("div", { class: "tip" }, h("strong", {}, "Free window"),
            h("div", {}, `${localText(p.value[1])} → ${localText(p.value[2])}`)) : ""),
      },
      xAxis: { type: "time", min: data.from, max: data.to, position: "top",
        splitLine: { show: true, lineStyle: { color: "#e5e5e5" } } },
      yAxis: { type: "category", inverse: true, data: rows.map((_, i) => String(i)), triggerEvent: true,
        axisLabel: { formatter: (v) => rows[Number(v)].label, color: "#222", fontSize: 12, width: 180, overflow: "truncate" },
        axisTick: { show: false }, splitLine: { show: true, lineStyle: { color: "#f0f0f0" } } },
      dataZoom: [
        { id: "x-inside", type: "inside", xAxisIndex: 0, filterMode: "weakFilter", minValueSpan: 3600e3,
          startValue: zoomX.startValue, endValue: zoomX.endValue, zoomOnMouseWheel: true, moveOnMouseMove: true },
        { id: "x-slider", type: "slider", xAxisIndex: 0, filterMode: "weakFilter", bottom: 12, height: 22,
          minValueSpan: 3600e3, startValue: zoomX.startValue, endValue: zoomX.endValue,
          labelFormatter: (v) => localText(v) },
        // A bar lies in one row: rows out of view are filtered out before drawing.
        { id: "y-slider", type: "slider", yAxisIndex: 0, filterMode: "filter", right: 8, width: 16,
          startValue: zoomY.startValue, endValue: zoomY.endValue, showDetail: false, zoomLock: true,
          show: rows.length > VISIBLE_ROWS },
        { id: "y-inside", type: "inside", yAxisIndex: 0, filterMode: "filter", zoomOnMouseWheel: false,
          moveOnMouseWheel: true, moveOnMouseMove: false, zoomLock: true },
      ],
      series: [
        { id: "bands", type: "custom", silent: true, encode: { x: [1, 2], y: 0 }, data: bands, z: 1,
          renderItem: (params, api) => {
            const y = api.coord([data.from, api.value(0)])[1];
            const band = api.size([0, 1])[1];
            const cs = params.coordSys;
            return { type: "rect", shape: { x: cs.x, y: y - band / 2, width: cs.width, height: band },
              style: { fill: api.value(3) === 2 ? "rgba(0,0,0,0.10)" : "rgba(213,94,0,0.14)" } };
          } },
        { id: "bars", type: "custom", encode: { x: [1, 2], y: 0 }, data: bars, z: 2,
          renderItem: (params, api) => {
            const row = api.value(0);
            const start = api.coord([api.value(1), row]);
            const end = api.coord([api.value(2), row]);
            const band = api.size([0, 1])[1] * 0.8;
            const top = start[1] - band / 2 + api.value(5) * band;
            const cs = params.coordSys;
            const shape = echarts.graphic.clipRectByRect(
              { x: start[0], y: top, width: Math.max(end[0] - start[0], 1), height: Math.max(api.value(6) * band, 1) },
              { x: cs.x, y: cs.y, width: cs.width, height: cs.height });
            if (!shape) return null;
            const code = api.value(3);
            return { type: "rect", shape, style: { fill: colourOf(data.states, code),
              stroke: api.value(4) >= 0 ? "#1b1b1b" : null, lineWidth: 0.5 } };
          },
          markLine: { silent: true, symbol: "none", animation: false,
            lineStyle: { color: "#000", width: 2, type: "solid" },
            label: { formatter: "now", position: "start", color: "#000" },
            data: [{ xAxis: data.now }] } },
        { id: "windows", type: "custom", encode: { x: [1, 2], y: 0 }, data: highlightItems(), z: 3,
          renderItem: (params, api) => {
            const row = api.value(0);
            const start = api.coord([api.value(1), row]);
            const end = api.coord([api.value(2), row]);
            const band = api.size([0, 1])[1];
            const cs = params.coordSys;
            const shape = echarts.graphic.clipRectByRect(
              { x: start[0], y: start[1] - band / 2, width: Math.max(end[0] - start[0], 2), height: band },
              { x: cs.x, y: cs.y, width: cs.width, height: cs.height });
            return shape && { type: "rect", shape,
              style: { fill: "rgba(240,228,66,0.55)", stroke: "#0072B2", lineWidth: 2 } };
          } },
      ],
    };
  }

  function currentZoom() {
    const zooms = (chart.getOption().dataZoom || []);
    const x = zooms.find((z) => z.id === "x-slider");
    const y = zooms.find((z) => z.id === "y-slider");
    if (!x) return null;
    return { startValue: x.startValue, endValue: x.endValue,
      rows: y ? { startValue: y.startValue, endValue: y.endValue } : null };
  }

  function redraw(keep = true) {
    const keepZoom = keep ? currentZoom() : null;
    const height = container.style.height;
    chart.setOption(option(keepZoom), { notMerge: true, lazyUpdate: false });
    if (container.style.height !== height) chart.resize(); // a node opened or closed
  }

  chart.on("click", (p) => {
    if (p.componentType === "yAxis") {
      const row = layout.rows[Number(p.value)];
      if (row && row.kind === "node") toggle(row.node);
      return;
    }
    if (p.seriesId === "bars") {
      const ref = p.value[4];
      if (ref >= 0 && options.onOpen) options.onOpen(data.reservations[ref]);
    }
    if (p.seriesId === "windows" && options.onPickWindow) options.onPickWindow(p.value);
  });

  function toggle(n) {
    if (expanded.has(n)) expanded.delete(n);
    else expanded.add(n);
    redraw(true);
    if (options.onToggle) options.onToggle(n, expanded.has(n));
  }

  const onResize = () => chart.resize();
  window.addEventListener("resize", onResize);
  chart.setOption(option(null));

  return {
    chart,
    update(next) { data = next; redraw(true); },
    setHighlights(list) { highlights = list || []; redraw(true); },
    toggle,
    isExpanded: (n) => expanded.has(n),
    /** Zoom the time axis to [start, end] (keyboard zoom buttons, a picked window). */
    zoomTo(start, end) {
      chart.dispatchAction({ type: "dataZoom", dataZoomIndex: 0, startValue: start, endValue: end });
      chart.dispatchAction({ type: "dataZoom", dataZoomIndex: 1, startValue: start, endValue: end });
    },
    span() { const z = currentZoom(); return z ? [z.startValue, z.endValue] : [data.from, data.to]; },
    dispose() { window.removeEventListener("resize", onResize); chart.dispose(); },
  };
}
