// A session, live: its turns oldest first (the newest page of them; older ones on request), each a
// timeline, and a message box. One stream (the session's firehose) feeds every turn; its cursor
// is kept in the page's URL, so a reload resumes after the last event shown and nothing is lost
// (a reloaded page reads the stored events too, and drops what it has already shown).

import { agentPath, api, enc, post, query } from "./api.js";
import { h, link, plural, problem, route, when, withQuery, replace } from "./dom.js";
import { Live } from "./live.js";
import { TurnView } from "./timeline.js";

const PAGE = 30;

export async function sessionView(main, { agent, key, query: q }, ctx) {
  const turns = new Map(); // turnId -> TurnView
  const list = h("div", { class: "turns", "aria-live": "off" });
  const older = h("button", { class: "secondary", hidden: true }, "Load older turns");
  const state = h("span", { class: "live-state", role: "status" }, "connecting…");
  const note = h("div", { class: "notice", role: "status" });
  let nextBefore = null;
  let lastCursor = q.get("after") || null;
  let backlog = []; // live events that came before the stored turns were listed
  let listed = false;

  const forkTurn = (turn) => ctx.go(withQuery(route("agents", agent, "sessions", key, "fork"), { turn: turn.turnId }));

  const meta = h("span", {}, "…");
  const box = messageBox(agent, key, note);
  replace(main,
    h("nav", { class: "crumbs", "aria-label": "breadcrumb" }, link(route(), "Agents"), " / ", link(route("agents", agent), agent), " / ", key),
    h("h1", {}, "Session ", h("code", {}, key)),
    h("p", { class: "meta" }, meta, " · ", state),
    older, list, note, box);

  // The summary is read beside the turns, not before them, and again when a turn starts or
  // ends (at most one read at a time), so it never goes on saying there are no turns.
  let summarising = null;
  let again = false;
  function summarise() {
    if (summarising) { again = true; return; }
    summarising = api(agentPath(agent, "sessions", enc(key))).then((summary) => replace(meta,
      `${plural(summary.turns, "turn")} · ${plural(summary.messages, "message")} in history · last active `, when(summary.lastActivityAt),
      summary.forkedFrom ? [" · forked from ", link(route("agents", summary.forkedFrom.agentId, "sessions", summary.forkedFrom.sessionKey), `${summary.forkedFrom.agentId}/${summary.forkedFrom.sessionKey}`), " at ", h("code", {}, summary.forkedFrom.turnId),
        " · ", link(withQuery(route("compare"), { a: `${summary.forkedFrom.agentId}/${summary.forkedFrom.sessionKey}`, b: `${agent}/${key}` }), "compare")] : null),
    ).catch((err) => replace(meta, err.status === 404 && !turns.size ? "No turns yet: send the first message below." : err.status === 404 ? "…" : `${err.code}: ${err.message}`))
      .finally(() => { summarising = null; if (again) { again = false; summarise(); } });
  }
  summarise();

  /** A turn is on the page: whatever said there were none is gone. */
  function shown(tv) {
    list.querySelector(":scope > p.empty")?.remove();
    return tv;
  }

  function view(turn) {
    let tv = turns.get(turn.turnId);
    if (!tv) {
      tv = new TurnView(agent, turn, { onFork: forkTurn });
      turns.set(turn.turnId, tv);
    }
    return tv;
  }

  /** Turns listed since the page was first listed (newest last). */
  async function newest() {
    const page = await api(agentPath(agent, "turns") + query({ sessionKey: key, limit: PAGE }));
    return page.turns.filter((t) => !turns.has(t.turnId)).reverse();
  }

  async function loadPage() {
    const page = await api(agentPath(agent, "turns") + query({ sessionKey: key, limit: PAGE, before: nextBefore }));
    nextBefore = page.nextBefore || null;
    older.hidden = !nextBefore;
    const fragment = document.createDocumentFragment();
    const fresh = page.turns.filter((t) => !turns.has(t.turnId)).reverse(); // oldest first
    for (const t of fresh) fragment.append(view(t).el);
    list.prepend(fragment);
    return fresh;
  }

  older.addEventListener("click", () => loadPage().catch((err) => replace(note, problem(err))));

  function onEvent(event) {
    if (event.sessionKey !== key || event.agentId !== agent) return;
    if (!listed) {
      backlog.push(event);
      return;
    }
    take(event);
  }

  function take(event) {
    let tv = event.turnId ? turns.get(event.turnId) : null;
    if (!tv && event.type === "turn.start") {
      tv = view({ turnId: event.turnId, status: "running", input: event.data.input, startedAt: event.ts });
      tv.startLive();
      list.append(shown(tv).el);
      tv.toggle(true);
    }
    if (tv) tv.live(event);
    if (event.type === "turn.start" || event.type === "turn.end") summarise();
    if (event.cursor) keepCursor(event.cursor);
  }

  let cursorTimer = null;
  function keepCursor(cursor) {
    lastCursor = cursor;
    if (cursorTimer) return;
    cursorTimer = setTimeout(() => {
      cursorTimer = null;
      const hash = withQuery(route("agents", agent, "sessions", key), { after: lastCursor });
      if (location.hash !== hash) history.replaceState(null, "", hash);
    }, 200);
  }

  const live = new Live({
    grant: { agentId: agent, sessionKey: key },
    params: { agentId: agent, sessionKey: key, chunks: "true", reasoning: "true" },
    onEvent,
    onState: (s, err) => { state.textContent = s === "failed" ? `stream refused: ${err.code}` : s; },
  });
  ctx.onLeave(() => live.close());
  // The stream and the stored turns are read at once. An event in both is shown once; a turn
  // that began before the subscription took hold but after the list was read is found by
  // listing the newest turns again once it has.
  live.start(lastCursor);
  try {
    const fresh = await loadPage();
    listed = true;
    const waiting = backlog;
    backlog = [];
    waiting.forEach(take);
    const open = fresh.filter((t, i) => t.status === "running" || i === fresh.length - 1);
    await Promise.all(open.map((t) => view(t).toggle(true)));
    performance.mark("dispach.timeline.ready");
    // Counted after the backlog is taken: a first turn that began live is a turn.
    if (!turns.size) list.append(h("p", { class: "empty" }, "No turns in this session yet."));
    await live.subscribed;
    for (const t of await newest()) {
      list.append(shown(view(t)).el);
      view(t).toggle(true);
      summarise();
    }
  } catch (err) {
    replace(list, problem(err));
  }
}

function messageBox(agent, key, note) {
  const text = h("textarea", { id: "message-text", name: "text", rows: 3, required: true, placeholder: "Write to the agent…" });
  const send = h("button", { type: "submit" }, "Send");
  const form = h("form", { class: "message-box", "aria-label": "send a message" },
    h("label", { for: "message-text" }, "Message"), text, send);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    if (!text.value.trim()) return;
    send.disabled = true;
    try {
      const answer = await post(agentPath(agent, "messages"), { text: text.value, sessionKey: key });
      replace(note, h("span", {}, "Accepted as ", h("code", {}, answer.turnId)));
      text.value = "";
    } catch (err) {
      replace(note, problem(err));
    } finally {
      send.disabled = false;
    }
  });
  text.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
  });
  return form;
}

/** Fork a session at one of its turns: a form naming the new session (and, optionally, agent). */
export async function forkView(main, { agent, key, query: q }, ctx) {
  const turnId = q.get("turn") || "";
  const agents = await api("/v1/agents");
  const newKey = h("input", { id: "fork-key", name: "newKey", placeholder: `${key}.fork-…` });
  const target = h("select", { id: "fork-agent", name: "agent" },
    agents.map((a) => h("option", { value: a.id, selected: a.id === agent }, a.id)));
  const out = h("div", { role: "status" });
  const go = h("button", { type: "submit" }, "Fork");
  const form = h("form", { class: "fork" },
    h("p", {}, "The new session starts with this session's history up to and including turn ", h("code", {}, turnId),
      ". The original is not changed."),
    h("label", { for: "fork-key" }, "New session key (empty: one is made)"), newKey,
    h("label", { for: "fork-agent" }, "Agent of the new session"), target, go, out);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    go.disabled = true;
    try {
      const body = { atTurn: turnId };
      if (newKey.value.trim()) body.newKey = newKey.value.trim();
      if (target.value !== agent) body.agent = target.value;
      const made = await post(agentPath(agent, "sessions", enc(key), "fork"), body);
      replace(out, h("p", {}, `Forked: ${made.messages} messages of ${made.forkedFrom.turns} turns. `,
        link(route("agents", made.agentId, "sessions", made.sessionKey), `Open ${made.agentId}/${made.sessionKey}`), " · ",
        link(withQuery(route("compare"), { a: `${agent}/${key}`, b: `${made.agentId}/${made.sessionKey}` }), "compare side by side")));
    } catch (err) {
      replace(out, problem(err));
    } finally {
      go.disabled = false;
    }
  });
  replace(main, h("nav", { class: "crumbs", "aria-label": "breadcrumb" }, link(route(), "Agents"), " / ", link(route("agents", agent), agent), " / ", link(route("agents", agent, "sessions", key), key), " / fork"),
    h("h1", {}, "Fork ", h("code", {}, key)), form);
}
