// What every view shares: building DOM from data (text only), calling the API with the
// console's cookie and CSRF header, showing times, and asking before a change.
// Never sets innerHTML/outerHTML/insertAdjacentHTML: everything a server or a user wrote
// reaches the page as text nodes, so a reservation named "<script>…" stays text.

/** The Okabe–Ito palette (safe for the common colour-vision deficiencies), one colour per state. */
export const PALETTE = {
  busy: "#9e9e9e",
  placed: "#56B4E9",
  binding: "#E69F00",
  active: "#009E73",
  releasing: "#CC79A7",
  spot: "#D55E00",
  // One's own reservation that was released, expired, cancelled or failed: its past stays.
  ended: "#e3e3e3",
  pending: "#0072B2",
  window: "#F0E442",
  unhealthy: "#D55E00",
  maintenance: "#000000",
};

let chartsLoading = null;
/**
 * ECharts, loaded once on first need (a classic script: it sets window.echarts). Loaded by
 * the page rather than by a <script> tag so that the API calls a view waits for start while
 * the library is still on its way.
 */
export function charts() {
  if (window.echarts) return Promise.resolve(window.echarts);
  if (!chartsLoading) {
    chartsLoading = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = "/console/assets/vendor/echarts.min.js";
      script.addEventListener("load", () => resolve(window.echarts));
      script.addEventListener("error", () => {
        chartsLoading = null;
        reject(new Error("The chart library did not load (/console/assets/vendor/echarts.min.js); reload the page."));
      });
      document.head.appendChild(script);
    });
  }
  return chartsLoading;
}

/** Build an element: attributes by name, children as nodes or text (never parsed as HTML). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

/**
 * Replace an element's children. Where the focus was on a child with a data-id (a row), the
 * new child with that id gets it back: a live update must not throw a keyboard user out.
 */
export function fill(el, ...children) {
  const focused = document.activeElement;
  const id = focused && el.contains(focused) && focused.dataset ? focused.dataset.id : undefined;
  el.replaceChildren();
  append(el, children);
  if (id !== undefined) {
    const again = [...el.querySelectorAll("[data-id]")].find((n) => n.dataset.id === id);
    if (again) again.focus();
  }
  return el;
}

const LOCAL = new Intl.DateTimeFormat(undefined, {
  weekday: "short", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
});

/** A time in the browser's zone, with UTC in its title (shown on hover). */
export function time(ms) {
  if (ms === undefined || ms === null) return h("span", { class: "muted" }, "—");
  const at = typeof ms === "number" ? new Date(ms) : new Date(ms);
  if (Number.isNaN(at.getTime())) return h("span", {}, String(ms));
  return h("time", { datetime: at.toISOString(), title: utc(at.getTime()) }, LOCAL.format(at));
}

export function localText(ms) {
  return LOCAL.format(new Date(ms));
}

export function utc(ms) {
  return new Date(ms).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
}

/** 93784000 → "1d 2h 3m". */
export function duration(ms) {
  if (!Number.isFinite(ms) || ms <= 0) return "0m";
  let m = Math.round(ms / 60000);
  const d = Math.floor(m / 1440);
  m -= d * 1440;
  const hours = Math.floor(m / 60);
  m -= hours * 60;
  return [d && `${d}d`, hours && `${hours}h`, m && `${m}m`].filter(Boolean).join(" ") || "0m";
}

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }
}

/** Where a 401 sends the page: the sign-in page, which comes back to this view. */
export function toSignin() {
  const back = location.hash && location.hash.startsWith("#/") ? location.hash : "";
  location.replace("/console/signin" + (back ? "?next=" + encodeURIComponent(back) : ""));
}

/**
 * One API operation ("reservations/list"): JSON in, `data` out. The cookie is the credential;
 * the X-Better-Compute header is the API's CSRF guard. A 401 leaves for the sign-in page.
 */
export async function api(operation, body = {}) {
  for (let attempt = 0; ; attempt += 1) {
    try {
      return await callOnce(operation, body);
    } catch (error) {
      // A read the server could not answer now (503, 429) is asked again after the pause it
      // names, twice at most; a change is never repeated behind the person's back.
      const again = error.status === 503 || error.status === 429;
      if (!again || !READS.test(operation) || attempt >= 2) throw error;
      const pause = Math.min(Number(error.details.retryAfterSeconds) || 1, 5);
      await new Promise((resolve) => { setTimeout(resolve, pause * 1000); });
    }
  }
}

/** Operations that only read: safe to ask again. */
const READS = /(^whoami$|\/(list|get|timeline|history|report|search|preview)$)/;

async function callOnce(operation, body) {
  let answer;
  try {
    answer = await fetch("/api/compute/" + operation, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Better-Compute": "1" },
      body: JSON.stringify(body),
    });
  } catch {
    throw new ApiError(0, "UNAVAILABLE", "The server did not answer; check it is running, then try again.");
  }
  if (answer.status === 401) {
    toSignin();
    throw new ApiError(401, "ACCESS_DENIED", "Signed out: sign in again.");
  }
  let parsed = null;
  try {
    parsed = await answer.json();
  } catch {
    parsed = null;
  }
  if (!answer.ok || !parsed || !("data" in parsed)) {
    const error = (parsed && parsed.error) || {};
    throw new ApiError(answer.status, error.code || "INTERNAL",
      error.message || `The server answered HTTP ${answer.status}.`, error.details);
  }
  return parsed.data;
}

/** An error as a block that says what happened and what to do. */
export function errorBox(error, what) {
  const hint = {
    UNAVAILABLE: "Try again in a moment.",
    NOT_FOUND: "It may have been removed, or you may not be allowed to see it.",
    ACCESS_DENIED: "Your identity may not do this; ask your platform team.",
    QUOTA_EXCEEDED: "Release something or ask for more quota (see Quota & usage).",
    CAPACITY_UNAVAILABLE: "Try Find a window for a time when it fits.",
    INVALID_INPUT: "Correct the field named above and try again.",
    CONFIRMATION_REQUIRED: "It waits for a person's approval in their Confirmations.",
    TOO_MANY_REQUESTS: "Slow down and try again in a moment.",
  }[error && error.code] || "Try again; if it keeps failing, the server's log says more.";
  const message = error instanceof ApiError ? `${error.code}: ${error.message}` : String(error);
  return h("div", { class: "error-box", role: "alert" },
    h("strong", {}, what ? `${what} failed. ` : ""), message, h("br"), h("span", { class: "muted" }, hint));
}

let noticeTimer = null;
/** A short message at the top of the page (aria-live), gone after a while. */
export function notice(text, kind = "ok") {
  const el = document.getElementById("notice");
  if (!el) return;
  el.className = "notice " + kind;
  el.textContent = text;
  el.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => { el.hidden = true; }, 8000);
}

/** Ask before a change, as a modal <dialog> (Escape or "Keep it" says no). */
export function confirmAction(title, text, okLabel) {
  const dialog = document.getElementById("confirm-dialog");
  fill(document.getElementById("confirm-title"), title);
  fill(document.getElementById("confirm-text"), text);
  fill(document.getElementById("confirm-ok"), okLabel);
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    document.getElementById("confirm-ok").focus();
  });
}

/** A key to create with: shown to the person, kept for retries of the same request. */
export function newKey(prefix) {
  const random = crypto.randomUUID().split("-")[0];
  const day = new Date().toISOString().slice(0, 10);
  return `${prefix}-${day}-${random}`;
}

/** Make a row (or any element) act as a button for the keyboard: focusable, Enter and Space. */
export function activatable(el, action, label) {
  el.tabIndex = 0;
  el.setAttribute("role", "link");
  if (label) el.setAttribute("aria-label", label);
  el.addEventListener("click", action);
  el.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      action();
    }
  });
  return el;
}

/** The request's devices as words: "4 × gpu (nvlink-all)". */
export function describeDevices(request) {
  const parts = ((request && request.devices) || []).map((d) => {
    let text = `${d.count} × ${d.class}`;
    if (d.profile) text += ` ${d.profile}`;
    if (d.topology && d.topology !== "any") text += ` (${d.topology})`;
    return text;
  });
  return parts.join(", ") || "—";
}

export function gpuCount(request) {
  return ((request && request.devices) || []).reduce((n, d) => n + (d.count || 0), 0);
}
