// What the model saw at one step of a turn: the blocks the context was assembled from (from the
// step's model.call context, or a v1 log's context.assembled: label, tokens, pinned) and the request exactly as sent (rebuilt
// from the log by GET …/turns/{id}/context), with what changed since the step before.

import { agentPath, api, enc, turnEvents } from "./api.js";
import { h, link, num, plural, pretty, route, table, withQuery, replace } from "./dom.js";

export async function contextView(main, { agent, turn, query: q }) {
  const [replay, resource] = await Promise.all([
    api(agentPath(agent, "turns", enc(turn), "context")),
    api(agentPath(agent, "turns", enc(turn))),
  ]);
  const assembled = [];
  await turnEvents(agent, turn, (events) => {
    // A step's blocks: its model.call's context (catalogue v2), or the context.assembled before
    // it (a v1 log, or a request over its budget that was never sent).
    for (const e of events) {
      if (e.type === "context.assembled") assembled.push(e.data);
      else if (e.type === "model.call" && e.data.context) assembled.push(e.data.context);
    }
  });
  const steps = replay.steps;
  const n = Math.min(Math.max(parseInt(q.get("step") || "1", 10) || 1, 1), Math.max(steps.length, 1));
  const here = steps.find((s) => s.step === n);
  const before = steps.find((s) => s.step === n - 1);
  const slots = assembled[n - 1];
  const base = route("agents", agent, "turns", turn, "context");
  replace(main, h("nav", { class: "crumbs", "aria-label": "breadcrumb" }, link(route(), "Agents"), " / ", link(route("agents", agent), agent), " / ",
      link(route("agents", agent, "sessions", resource.sessionKey), resource.sessionKey), " / ", turn),
    h("h1", {}, "What the model saw"),
    h("p", { class: "meta" }, `Turn ${turn}: “${resource.input.slice(0, 120)}” · ${plural(steps.length, "model call")}`),
    steps.length
      ? h("nav", { class: "steps", "aria-label": "steps" }, steps.map((s) =>
          link(withQuery(base, { step: s.step }), `Step ${s.step}`, s.step === n ? { "aria-current": "page" } : {})))
      : h("p", { class: "empty" }, "This turn made no model call."),
    here ? stepDetail(here, before, slots) : null,
  );
}

function stepDetail(step, before, assembled) {
  const request = { system: step.system, tools: step.tools, messages: step.messages };
  return h("div", { class: "step-detail", dataset: { step: step.step } },
    h("section", { "aria-labelledby": "h-blocks" }, h("h2", { id: "h-blocks" }, "Blocks"),
      assembled
        ? [h("p", { class: "meta" }, `${num(assembled.total)} tokens of a ${num(assembled.budget)} budget (window ${num(assembled.window)}) · ${assembled.breakpoints} cache breakpoints`),
          table("Context blocks", [
            { label: "#", cell: (s) => String(s.slot) },
            { label: "Block", cell: (s) => s.label },
            { label: "Tokens", cell: (s) => num(s.tokens) },
            { label: "Pinned", cell: (s) => (s.pinned ? "pinned" : "—") },
          ], assembled.slots)]
        : h("p", { class: "muted" }, "No context was recorded for this step.")),
    h("section", { "aria-labelledby": "h-diff" }, h("h2", { id: "h-diff" }, before ? `Changed since step ${before.step}` : "First step"),
      before ? diff(before, step) : h("p", { class: "muted" }, "Nothing to compare with: this is the turn's first model call.")),
    h("section", { "aria-labelledby": "h-request" }, h("h2", { id: "h-request" }, "The request as sent"),
      h("h3", {}, "System"), systemBlocks(step.system),
      h("h3", {}, `Messages (${step.messages.length})`),
      h("ol", { class: "messages" }, step.messages.map((m) => message(m))),
      h("h3", {}, `Tools (${step.tools.length})`),
      h("p", {}, step.tools.map((t) => t.name || t.type).join(", ") || "none"),
      h("details", {}, h("summary", {}, "Raw request (JSON)"), h("pre", { class: "json", id: "request-json" }, JSON.stringify(request, null, 2)))),
  );
}

function systemBlocks(system) {
  if (typeof system === "string") return h("pre", { class: "text" }, system);
  return h("ol", { class: "messages" }, (system || []).map((b) => h("li", {}, b.cache_control ? h("span", { class: "badge" }, "cache breakpoint") : null, h("pre", { class: "text" }, b.text ?? JSON.stringify(b)))));
}

function message(m) {
  const content = typeof m.content === "string" ? [{ type: "text", text: m.content }] : m.content || [];
  return h("li", { class: `message ${m.role}` }, h("strong", {}, m.role),
    content.map((b) => (b.type === "text" ? h("pre", { class: "text" }, b.text) : pretty(b))));
}

/** Messages: the common prefix is unchanged; what follows it was added (or, rarely, replaced by
 * compaction). System and tools: changed or not. */
function diff(a, b) {
  // A cache breakpoint moves to the newest message each step: it is not a change of content.
  const plain = (x) => JSON.stringify(x, (k, v) => (k === "cache_control" ? undefined : v));
  const same = (x, y) => plain(x) === plain(y);
  let prefix = 0;
  while (prefix < a.messages.length && prefix < b.messages.length && same(a.messages[prefix], b.messages[prefix])) prefix++;
  const removed = a.messages.slice(prefix);
  const added = b.messages.slice(prefix);
  return h("div", { class: "diff" },
    h("p", {}, same(a.system, b.system) ? "System: unchanged." : "System: changed.", " ",
      same(a.tools, b.tools) ? "Tools: unchanged." : "Tools: changed.", " ",
      `Messages: ${prefix} unchanged, ${added.length} added, ${removed.length} removed.`),
    removed.length ? h("ol", { class: "messages removed", "aria-label": "removed messages" }, removed.map(message)) : null,
    added.length ? h("ol", { class: "messages added", "aria-label": "added messages" }, added.map(message)) : null);
}
