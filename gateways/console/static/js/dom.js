// Building the page: every node is made here, and text goes in with textContent only (never as
// markup), so nothing an event carries can become HTML.

/** An element: h("a", {href: "#/", class: "x", onclick: fn}, "text", child, [more]). */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (key === "class") {
      el.className = value;
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (key === "text") {
      el.textContent = value;
    } else if (key === "value" || key === "checked") {
      el[key] = value;
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

/** A table of rows: columns [{label, cell: row => node|string}]. */
export function table(caption, columns, rows, empty = "Nothing here yet.") {
  if (!rows.length) return h("p", { class: "empty" }, empty);
  return h(
    "table",
    {},
    h("caption", { class: "visually-hidden" }, caption),
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c.label)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, columns.map((c) => h("td", {}, c.cell(r)))))),
  );
}

export function link(href, text, attrs = {}) {
  return h("a", { href, ...attrs }, text);
}

/** "#/agents/a b" with each part encoded. */
export function route(...parts) {
  return "#/" + parts.map((p) => encodeURIComponent(String(p))).join("/");
}

export function withQuery(hash, query) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(query)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const s = q.toString();
  return s ? `${hash}?${s}` : hash;
}

const pad = (n, w = 2) => String(n).padStart(w, "0");

/** 14:03:07.125 in local time. */
export function clock(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

/** 2026-12-03 14:03 in local time, with the full instant as a tooltip. */
export function when(iso) {
  if (!iso) return h("span", { class: "muted" }, "—");
  const d = new Date(iso);
  const text = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}`;
  return h("time", { datetime: iso, title: iso }, text);
}

const numbers = new Intl.NumberFormat("en-US"); // one formatter: toLocaleString makes one a call

export function num(n) {
  return n === undefined || n === null ? "—" : numbers.format(n);
}

/** "1 step", "2 steps": a count and its noun, singular for one. */
export function plural(n, one, many = `${one}s`) {
  return `${num(n)} ${n === 1 ? one : many}`;
}

/** A cost in US dollars (null: not known, a price is missing). */
export function usd(value) {
  if (value === undefined) return "";
  if (value === null) return "cost unknown";
  return `$${value < 0.01 && value > 0 ? value.toPrecision(2) : value.toFixed(value >= 100 ? 0 : 4)}`;
}

export function badge(text, kind) {
  return h("span", { class: `badge ${kind || text}` }, text);
}

export function status(text) {
  const kind = { final: "ok", sent: "ok", running: "live", sending: "live", pending: "wait",
    retrying: "wait", awaiting_approval: "wait", uncertain: "warn", stopped: "warn",
    max_steps: "warn", timeout: "bad", error: "bad", failed: "bad", refused: "warn",
    output_limit: "warn", truncated: "warn" }[text];
  return h("span", { class: `status ${kind || "plain"}` }, text || "—");
}

/** A short JSON for a summary line (whole in a <pre> elsewhere). */
export function brief(value, max = 120) {
  const text = typeof value === "string" ? value : JSON.stringify(value);
  if (text === undefined) return "";
  return text.length > max ? text.slice(0, max - 1) + "…" : text;
}

export function pretty(value) {
  return h("pre", { class: "json" }, typeof value === "string" ? value : JSON.stringify(value, null, 2));
}

/** A banner for a failed call: the API's code, message and hint. */
export function problem(err) {
  return h(
    "div",
    { class: "problem", role: "alert" },
    h("strong", {}, err.code || "error"),
    " ",
    err.message || String(err),
    err.hint ? h("div", { class: "hint" }, "Hint: ", err.hint) : null,
  );
}

/** Replace an element's children (skipping null, undefined and false, as h() does). */
export function replace(el, ...children) {
  clear(el);
  return append(el, children);
}
