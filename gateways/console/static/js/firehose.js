// The firehose: every event of an agent as it is logged, filtered by type, resumable after a
// reload (the cursor of the last event shown is kept in the URL). And two sessions side by side.

import { agentPath, api, query } from "./api.js";
import { brief, clock, h, link, plural, problem, route, status, usd, withQuery, replace } from "./dom.js";
import { eventTypes, Live } from "./live.js";

const KEEP = 2000; // rows kept on the page; older ones are dropped as new ones come

export async function firehoseView(main, { query: q }, ctx) {
  const [agents, types] = await Promise.all([api("/v1/agents"), eventTypes()]);
  if (!agents.length) {
    replace(main, h("h1", {}, "Firehose"), h("p", { class: "empty" }, "No agents."));
    return;
  }
  const agent = q.get("agent") || agents[0].id;
  const chosen = new Set((q.get("types") || "").split(",").filter(Boolean));
  let cursor = q.get("after") || "";
  const seen = new Set();
  const rows = h("ol", { class: "firehose", "aria-label": "events" });
  const state = h("span", { class: "live-state", role: "status" }, "connecting…");
  const pickAgent = h("select", { id: "fh-agent", name: "agent" }, agents.map((a) => h("option", { value: a.id, selected: a.id === agent }, a.id)));
  const boxes = types.map((t) => h("label", { class: "check" }, h("input", { type: "checkbox", name: "types", value: t, checked: chosen.has(t) }), t));
  const form = h("form", { class: "filters", "aria-label": "firehose filters" },
    h("label", { for: "fh-agent" }, "Agent"), pickAgent,
    h("fieldset", {}, h("legend", {}, "Types (none: all but text chunks)"), boxes),
    h("button", { type: "submit" }, "Apply"));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const picked = boxes.map((b) => b.firstChild).filter((i) => i.checked).map((i) => i.value);
    ctx.go(withQuery("#/firehose", { agent: pickAgent.value, types: picked.join(",") }));
  });
  replace(main, h("h1", {}, "Firehose"), h("p", { class: "meta" }, `Events of ${agent}, as they are logged · `, state), form, rows);

  let timer = null;
  const keep = () => {
    if (timer) return;
    timer = setTimeout(() => {
      timer = null;
      history.replaceState(null, "", withQuery("#/firehose", { agent, types: [...chosen].join(","), after: cursor }));
    }, 200);
  };
  const live = new Live({
    grant: { agentId: agent },
    params: { agentId: agent, types: [...chosen].join(",") },
    onEvent: (e) => {
      if (seen.has(e.id)) return;
      seen.add(e.id);
      rows.append(h("li", { class: "row", dataset: { id: e.id, type: e.type, cursor: e.cursor } },
        h("time", { datetime: e.ts, class: "ts" }, clock(e.ts)),
        h("span", { class: "type" }, e.type),
        h("span", { class: "where" }, e.sessionKey ? link(route("agents", e.agentId, "sessions", e.sessionKey), e.sessionKey) : ""),
        h("span", { class: "what" }, brief(e.data, 160))));
      while (rows.childElementCount > KEEP) rows.firstElementChild.remove();
      if (e.cursor) {
        cursor = e.cursor;
        keep();
      }
    },
    onState: (s, err) => { state.textContent = s === "failed" ? `stream refused: ${err.code}` : s; },
  });
  ctx.onLeave(() => live.close());
  await live.start(cursor);
}

/** "agent/key" → [agent, key] (session keys never contain "/"). */
function parseRef(ref) {
  const at = (ref || "").indexOf("/");
  return at > 0 ? [ref.slice(0, at), ref.slice(at + 1)] : [null, null];
}

export async function compareView(main, { query: q }) {
  const refs = [q.get("a"), q.get("b")];
  const columns = await Promise.all(refs.map(async (ref, side) => {
    const [agent, key] = parseRef(ref);
    if (!agent) return h("section", { class: "column" }, h("p", { class: "empty" }, "Name a session as agent/key."));
    try {
      const page = await api(agentPath(agent, "turns") + query({ sessionKey: key, limit: 100 }));
      const summary = await api(agentPath(agent, "sessions", encodeURIComponent(key))).catch(() => null);
      return h("section", { class: "column", "aria-label": `${side ? "right" : "left"}: ${agent}/${key}` },
        h("h2", {}, link(route("agents", agent, "sessions", key), `${agent}/${key}`)),
        summary && summary.forkedFrom ? h("p", { class: "meta" }, `forked from ${summary.forkedFrom.agentId}/${summary.forkedFrom.sessionKey} at ${summary.forkedFrom.turnId}`) : null,
        h("ol", { class: "compare-turns" }, page.turns.slice().reverse().map((t) => h("li", { dataset: { turnId: t.turnId } },
          h("div", {}, status(t.status), " ", h("strong", {}, t.input)),
          h("div", { class: "text" }, t.text),
          h("div", { class: "meta" }, `${plural(t.steps, "step")} · ${t.promptTokens} in / ${t.outputTokens} out · ${t.costUsd !== undefined ? `${usd(t.costUsd)} · ` : ""}`, link(route("agents", agent, "turns", t.turnId, "context"), "what the model saw"))))));
    } catch (err) {
      return h("section", { class: "column" }, problem(err));
    }
  }));
  const a = h("input", { id: "cmp-a", name: "a", value: refs[0] || "", placeholder: "agent/key" });
  const b = h("input", { id: "cmp-b", name: "b", value: refs[1] || "", placeholder: "agent/key" });
  const form = h("form", { class: "filters", "aria-label": "sessions to compare" },
    h("label", { for: "cmp-a" }, "Left"), a, h("label", { for: "cmp-b" }, "Right"), b, h("button", { type: "submit" }, "Compare"));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    location.hash = withQuery("#/compare", { a: a.value.trim(), b: b.value.trim() });
  });
  replace(main, h("h1", {}, "Compare sessions"), form, h("div", { class: "compare" }, columns));
}
