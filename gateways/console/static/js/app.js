// The console's shell: hash routes to views, the sign-in form when the node asks for a token,
// and one cleanup per view (its streams and timers) when the route changes.

import { api, onUnauthorized, setToken, token } from "./api.js";
import { h, problem, replace } from "./dom.js";
import { agentsView, agentView } from "./agents.js";
import { approvalsView, deliveriesView } from "./approvals.js";
import { contextView } from "./context.js";
import { compareView, firehoseView } from "./firehose.js";
import { forkView, sessionView } from "./session.js";

const ROUTES = [
  [/^$/, agentsView, []],
  [/^agents\/([^/]+)$/, agentView, ["agent"]],
  [/^agents\/([^/]+)\/sessions\/([^/]+)$/, sessionView, ["agent", "key"]],
  [/^agents\/([^/]+)\/sessions\/([^/]+)\/fork$/, forkView, ["agent", "key"]],
  [/^agents\/([^/]+)\/turns\/([^/]+)\/context$/, contextView, ["agent", "turn"]],
  [/^approvals$/, approvalsView, []],
  [/^deliveries$/, deliveriesView, []],
  [/^firehose$/, firehoseView, []],
  [/^compare$/, compareView, []],
];

const main = document.getElementById("view");
let leaving = [];
let generation = 0;

function parse(hash) {
  const raw = hash.replace(/^#\/?/, "");
  const at = raw.indexOf("?");
  const path = at < 0 ? raw : raw.slice(0, at);
  return { path, query: new URLSearchParams(at < 0 ? "" : raw.slice(at + 1)) };
}

async function show() {
  for (const fn of leaving.splice(0)) fn();
  const mine = ++generation;
  const { path, query } = parse(location.hash);
  markNav(path);
  const found = ROUTES.map(([re, view, names]) => [path.match(re), view, names]).find(([m]) => m);
  if (!found) {
    replace(main, h("h1", {}, "Not found"), h("p", {}, "No such page in the console. ", h("a", { href: "#/" }, "Go to the agents.")));
    return;
  }
  const [match, view, names] = found;
  const params = { query };
  names.forEach((name, i) => { params[name] = decodeURIComponent(match[i + 1]); });
  // Each view renders into an element of its own, put in place now: a view still loading when
  // the route changes again writes into its element, by then out of the page, never over the
  // newer view (a slow first view used to land over the one the person had moved on to).
  const root = h("div", { class: "view-root" }, h("p", { class: "muted", role: "status" }, "Loading…"));
  replace(main, root);
  const ctx = {
    go: (hash) => { location.hash = hash; },
    onLeave: (fn) => (mine === generation ? leaving.push(fn) : fn()),
  };
  try {
    await view(root, params, ctx);
    if (mine !== generation) return;
    document.title = `${root.querySelector("h1")?.textContent || "Console"} · Dispach`;
  } catch (err) {
    if (mine !== generation) return;
    if (err.status === 401) return; // the sign-in form is up
    replace(root, h("h1", {}, "Something went wrong"), problem(err));
  }
}

function markNav(path) {
  const section = path.split("/")[0] || "agents";
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.section === section) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

function signIn(err) {
  for (const fn of leaving.splice(0)) fn();
  generation++;
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "current-password", required: true });
  const form = h("form", { class: "sign-in", "aria-labelledby": "h-sign-in" },
    h("h1", { id: "h-sign-in" }, "Sign in"),
    h("p", {}, "This node asks for a bearer token (one of DISPACH_API_TOKEN's) or an API key (dsp_…). It stays in this tab only."),
    token() ? problem(err) : null,
    h("label", { for: "token" }, "API token or key"), input,
    h("button", { type: "submit" }, "Sign in"));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    setToken(input.value.trim());
    try {
      await api("/v1/agents");
      renderSession();
      show();
    } catch (failure) {
      if (failure.status !== 401) replace(main, problem(failure));
    }
  });
  setToken("");
  renderSession();
  replace(main, form);
  input.focus();
}

function renderSession() {
  const slot = document.getElementById("session");
  replace(slot, token()
    ? h("button", { class: "secondary", onclick: () => { setToken(""); location.reload(); } }, "Sign out")
    : "");
}

document.querySelector(".skip").addEventListener("click", (e) => {
  e.preventDefault();
  main.focus();
});
onUnauthorized(signIn);
window.addEventListener("hashchange", show);
renderSession();
api("/v1/health").then((health) => {
  document.getElementById("version").textContent = `v${health.version} · ${health.nodeId}`;
}).catch(() => {});
show();
