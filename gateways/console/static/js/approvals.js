// Approvals waiting now, across every agent the token sees, answered on the live turn; outbox
// deliveries and schedules.

import { agentPath, api, enc, post, query } from "./api.js";
import { h, link, problem, route, status, table, when, replace } from "./dom.js";
import { scheduleTable } from "./agents.js";

export async function approvalsView(main, { query: q }, ctx) {
  const list = h("div", {});
  const note = h("div", { role: "status", class: "notice" });
  replace(main, h("h1", {}, "Approvals"), h("p", { class: "meta" }, "Tool calls waiting for a person. The turn goes on once every call of its step is answered."), note, list);

  async function refresh() {
    const agents = (await api("/v1/agents")).filter((a) => !q.get("agent") || a.id === q.get("agent"));
    const waiting = (await Promise.all(agents.map((a) => api(agentPath(a.id, "approvals") + query({ private: "true" })).then((r) => r.approvals)))).flat();
    waiting.sort((x, y) => (x.requestedAt < y.requestedAt ? -1 : 1));
    replace(list, table("Approvals", [
      { label: "Tool", cell: (a) => [h("code", {}, a.slug), a.mutating ? " (mutating)" : ""] },
      { label: "Arguments", cell: (a) => (a.args ? h("pre", { class: "json args" }, JSON.stringify(a.args, null, 2)) : h("span", { class: "muted" }, "not recorded")) },
      { label: "Why", cell: (a) => a.reason || "—" },
      { label: "Agent", cell: (a) => a.agentId },
      { label: "Session", cell: (a) => link(route("agents", a.agentId, "sessions", a.sessionKey), a.sessionKey) },
      { label: "Asked", cell: (a) => when(a.requestedAt) },
      { label: "Expires", cell: (a) => when(a.expiresAt) },
      { label: "Answer", cell: (a) => h("span", { class: "buttons" },
        h("button", { class: "approve", "aria-label": `Approve ${a.slug} (${a.approvalId})`, onclick: () => answer(a, true) }, "Approve"),
        h("button", { class: "deny", "aria-label": `Deny ${a.slug} (${a.approvalId})`, onclick: () => answer(a, false) }, "Deny")) },
    ], waiting, "Nothing is waiting for approval."));
  }

  async function answer(a, granted) {
    try {
      await post(agentPath(a.agentId, "approvals", enc(a.approvalId)), { granted });
      replace(note, h("span", {}, `${granted ? "Approved" : "Denied"} ${a.slug} for turn `,
        link(route("agents", a.agentId, "sessions", a.sessionKey), a.turnId), "."));
    } catch (err) {
      replace(note, problem(err));
    }
    await refresh().catch((err) => replace(note, problem(err)));
  }

  await refresh();
  const timer = setInterval(() => refresh().catch(() => {}), 2000);
  ctx.onLeave(() => clearInterval(timer));
}

const DELIVERY_STATES = ["", "pending", "sending", "retrying", "sent", "failed", "uncertain"];

export async function deliveriesView(main, { query: q }, ctx) {
  const agents = await api("/v1/agents");
  const pick = h("select", { id: "delivery-status", name: "status" }, DELIVERY_STATES.map((s) => h("option", { value: s, selected: (q.get("status") || "") === s }, s || "any")));
  pick.addEventListener("change", () => ctx.go(`#/deliveries${query({ status: pick.value })}`));
  const deliveries = (await Promise.all(agents.map((a) =>
    api(agentPath(a.id, "deliveries") + query({ status: q.get("status"), limit: 200 })).then((r) => r.deliveries.map((d) => ({ ...d, agentId: a.id })))))).flat();
  deliveries.sort((x, y) => (x.createdAt < y.createdAt ? 1 : -1));
  const schedules = (await Promise.all(agents.map((a) =>
    api(agentPath(a.id, "schedules")).then((r) => r.schedules.map((s) => ({ ...s, agent: a.id })))))).flat();
  replace(main, h("h1", {}, "Deliveries and schedules"),
    h("section", { "aria-labelledby": "h-outbox" }, h("h2", { id: "h-outbox" }, "Outbox"),
      h("form", { class: "filters", "aria-label": "filter deliveries" }, h("label", { for: "delivery-status" }, "Status"), pick),
      table("Deliveries", [
        { label: "Status", cell: (d) => status(d.status) },
        { label: "Channel", cell: (d) => d.channel },
        { label: "Agent", cell: (d) => d.agentId },
        { label: "Session", cell: (d) => (d.sessionKey ? link(route("agents", d.agentId, "sessions", d.sessionKey), d.sessionKey) : "—") },
        { label: "Attempts", cell: (d) => String(d.attempts) },
        { label: "Last error", cell: (d) => (d.lastError ? `${d.lastError.code || ""} ${d.lastError.message || ""}` : "—") },
        { label: "Created", cell: (d) => when(d.createdAt) },
        { label: "Updated", cell: (d) => when(d.updatedAt || d.sentAt) },
      ], deliveries, "No deliveries.")),
    h("section", { "aria-labelledby": "h-schedules" }, h("h2", { id: "h-schedules" }, "Schedules"), scheduleTable(schedules, "all")),
  );
}
