// Agents (what each runs with) and an agent's sessions (newest first, searchable by key,
// filtered by how their last turn ended).

import { agentPath, api, query } from "./api.js";
import { badge, h, link, num, problem, route, status, table, when, withQuery, replace } from "./dom.js";

const STATUSES = ["running", "final", "stopped", "max_steps", "timeout", "output_limit", "truncated", "refused", "error"];

export async function agentsView(main) {
  const agents = await api("/v1/agents");
  replace(main, h("h1", {}, "Agents"),
    table("Agents", [
      { label: "Agent", cell: (a) => link(route("agents", a.id), a.id) },
      { label: "Name", cell: (a) => a.name },
      { label: "Model", cell: (a) => [a.model, a.provider === a.model ? "" : h("span", { class: "muted" }, ` (${a.provider})`)] },
      { label: "Status", cell: (a) => badge(a.status) },
      { label: "Channels", cell: (a) => (a.channels || []).join(", ") || "—" },
    ], agents, "No agents are loaded."),
  );
}

export async function agentView(main, { agent, query: q }, ctx) {
  const [detail, schedules] = await Promise.all([
    api(agentPath(agent)),
    api(agentPath(agent, "schedules")).catch(() => ({ schedules: [] })),
  ]);
  const search = h("input", { id: "session-search", type: "search", name: "q", value: q.get("q") || "", placeholder: "part of a key" });
  const pick = h("select", { id: "session-status", name: "status" },
    h("option", { value: "" }, "any"), STATUSES.map((s) => h("option", { value: s, selected: q.get("status") === s }, s)));
  const filters = h("form", { class: "filters", role: "search", "aria-label": "filter sessions" },
    h("label", { for: "session-search" }, "Search by key"), search,
    h("label", { for: "session-status" }, "Last turn"), pick,
    h("button", { type: "submit" }, "Filter"));
  filters.addEventListener("submit", (e) => {
    e.preventDefault();
    ctx.go(withQuery(route("agents", agent), { q: search.value.trim(), status: pick.value }));
  });
  const sessions = h("div", {}, h("p", { class: "muted" }, "loading…"));
  const limits = Object.entries(detail.limits || {});
  replace(main, h("nav", { class: "crumbs", "aria-label": "breadcrumb" }, link(route(), "Agents"), " / ", agent),
    h("h1", {}, detail.name, " ", h("code", {}, detail.id)),
    detail.warnings && detail.warnings.length ? h("div", { class: "notice", role: "note" }, detail.warnings.join(" · ")) : null,
    h("dl", { class: "facts" },
      h("dt", {}, "Model"), h("dd", {}, detail.model === detail.provider ? detail.model : `${detail.model} (${detail.provider})`),
      h("dt", {}, "Status"), h("dd", {}, detail.status),
      h("dt", {}, "Sessions run"), h("dd", {}, detail.concurrency),
      h("dt", {}, "Output tokens per call"), h("dd", {}, num(detail.maxOutputTokens)),
      h("dt", {}, "Channels"), h("dd", {}, (detail.channels || []).join(", ") || "none")),
    h("section", { "aria-labelledby": "h-sessions" }, h("h2", { id: "h-sessions" }, "Sessions"), filters, sessions),
    h("section", { "aria-labelledby": "h-tools" }, h("h2", { id: "h-tools" }, "Tools"),
      table("Tools", [
        { label: "Tool", cell: (t) => h("code", {}, t.slug) },
        { label: "Policy", cell: (t) => badge(t.policy) },
        { label: "Mutating", cell: (t) => (t.mutating ? "yes" : "no") },
        { label: "Output", cell: (t) => t.trust },
        { label: "Timeout", cell: (t) => `${t.timeoutS} s` },
        { label: "What it does", cell: (t) => h("span", { class: "summary" }, t.summary) },
      ], detail.toolList, "No tools.")),
    h("section", { "aria-labelledby": "h-schedules" }, h("h2", { id: "h-schedules" }, "Schedules"), scheduleTable(schedules.schedules)),
    h("section", { "aria-labelledby": "h-limits" }, h("h2", { id: "h-limits" }, "Limits"),
      h("dl", { class: "facts" }, limits.map(([k, v]) => [h("dt", {}, k), h("dd", {}, typeof v === "object" ? JSON.stringify(v) : String(v))]))),
  );
  try {
    const found = await api(agentPath(agent, "sessions") + query({ q: q.get("q"), status: q.get("status"), limit: 200 }));
    replace(sessions, table("Sessions", [
      { label: "Session", cell: (s) => link(route("agents", agent, "sessions", s.sessionKey), s.sessionKey) },
      { label: "Last turn", cell: (s) => status(s.lastTurnStatus) },
      { label: "Turns", cell: (s) => num(s.turns) },
      { label: "Messages", cell: (s) => num(s.messages) },
      { label: "Last active", cell: (s) => when(s.lastActivityAt) },
      { label: "Forked from", cell: (s) => (s.forkedFrom ? link(route("agents", s.forkedFrom.agentId, "sessions", s.forkedFrom.sessionKey), `${s.forkedFrom.agentId}/${s.forkedFrom.sessionKey}`) : "—") },
    ], found, q.get("q") || q.get("status") ? "No session matches." : "No sessions yet."));
  } catch (err) {
    replace(sessions, problem(err));
  }
}

export function scheduleTable(schedules, agent) {
  return table("Schedules", [
    ...(agent ? [{ label: "Agent", cell: (s) => s.agent || agent }] : []),
    { label: "Schedule", cell: (s) => h("code", {}, s.id) },
    { label: "When", cell: (s) => `${s.kind} ${s.expr}${s.timezone ? ` (${s.timezone})` : ""}` },
    { label: "Enabled", cell: (s) => (s.enabled ? "yes" : "no") },
    { label: "Next fire", cell: (s) => when(s.nextDue) },
    { label: "Last fire", cell: (s) => when(s.lastFiredAt) },
    { label: "Fired / skipped", cell: (s) => `${num(s.fired)} / ${num(s.skipped)}` },
    { label: "Task", cell: (s) => h("span", { class: "summary" }, s.task) },
  ], schedules, "No schedules.");
}
