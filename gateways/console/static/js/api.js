// The one way the console talks to the node: API v1 on the page's own origin. The bearer token
// (when the node has one) lives in this tab's sessionStorage and goes in the Authorization
// header only; streams use short-lived stream tokens in ?st=, as the API asks browsers to.

const TOKEN_KEY = "dispach.console.token";
const listeners = new Set();

export class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || `http_${status}`;
    this.hint = e.hint || "";
    this.field = e.field;
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** Called with the error whenever the node answers 401 (the app shows the sign-in form). */
export function onUnauthorized(fn) {
  listeners.add(fn);
}

function headers(extra) {
  const out = { Accept: "application/json", ...extra };
  const t = token();
  if (t) out.Authorization = `Bearer ${t}`;
  return out;
}

/** GET (or another method with a JSON body): the parsed answer, or throws ApiError. */
export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw Object.assign(new ApiError(0, { error: { code: "node_unreachable",
      message: "the node did not answer", hint: "is `dispach serve` running?" } }), { cause: err });
  }
  const text = await response.text();
  let parsed = null;
  try {
    parsed = text ? JSON.parse(text) : null;
  } catch {
    parsed = null;
  }
  if (!response.ok) {
    const err = new ApiError(response.status, parsed);
    if (response.status === 401) for (const fn of listeners) fn(err);
    throw err;
  }
  return parsed;
}

export const post = (path, body, opts = {}) => api(path, { ...opts, method: "POST", body });

export const enc = encodeURIComponent;

export function agentPath(agent, ...rest) {
  return [`/v1/agents/${enc(agent)}`, ...rest].join("/");
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  const s = q.toString();
  return s ? `?${s}` : "";
}

/** A read-only stream token for an agent, one of its sessions, or one turn. */
export async function streamToken(grant) {
  const answer = await post("/v1/stream-tokens", { ttlS: 600, ...grant });
  return answer.token;
}

const PAGE = 1000;

/** Every page of a turn's stored events, in log order, calling onPage(events) per page; the
 * next page is asked for while onPage handles this one. */
export async function turnEvents(agent, turnId, onPage) {
  const path = agentPath(agent, "turns", enc(turnId), "events");
  const ask = (after) => api(path + query({ after, limit: PAGE }));
  let next = ask("");
  for (;;) {
    const page = await next;
    const more = page.next && page.events.length === PAGE;
    if (more) next = ask(page.next);
    onPage(page.events);
    if (!more) return;
  }
}
