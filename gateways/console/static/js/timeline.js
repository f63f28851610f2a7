// A turn as a timeline of its events, rendered incrementally: each event becomes one row (or, for
// a model.chunk, one span appended to its step's text), added once (deduped by event id) and
// never re-rendered. Events that arrive live before the turn's stored events were read wait in
// `pending`, so what is shown is always in log order.

import { agentPath, api, enc, query, turnEvents } from "./api.js";
import { brief, clock, h, link, num, plural, pretty, route, status, usd, withQuery, replace } from "./dom.js";

/** One line per event type: what a person wants to read at a glance. */
const SUMMARY = {
  "turn.start": (d) => [d.source, " · ", brief(d.input, 200), d.attempt ? ` · began on ${d.node || "its node"}` : ""],
  "turn.attempt": (d) => [`attempt ${d.attempt} on ${d.node}`, d.resumedFromStep ? ` (resumed at step ${d.resumedFromStep})` : ""],
  "context.assembled": (d) => [`${d.slots.length} blocks · ${num(d.total)} tokens of ${num(d.budget)} · ${d.breakpoints} cache breakpoints`],
  "context.pressure": (d) => [`${(d.fraction * 100).toFixed(1)}% of the budget (${d.source})`, d.peak ? ` · ${(d.peak * 100).toFixed(1)}% before compaction` : ""],
  "compaction.stage": (d) => [`${d.stage}: ${num(d.before)} → ${num(d.after)} tokens`, d.fallback ? ` (fallback: ${d.fallback})` : ""],
  // Catalogue v2: a model.call carries its context and pressure (v1 wrote them as the two events above).
  "model.call": (d) => [
    `${d.model} · ${num(d.promptTokens)} prompt tokens`, d.attempt > 1 ? ` · attempt ${d.attempt}` : "",
    d.context ? ` · ${d.context.slots.length} blocks, ${d.context.breakpoints} cache breakpoints` : "",
    d.pressure ? ` · ${(d.pressure.fraction * 100).toFixed(1)}% of the budget (${d.pressure.source})` : "",
    d.pressure && d.pressure.peak ? `, ${(d.pressure.peak * 100).toFixed(1)}% before compaction` : "",
  ],
  "model.retry": (d) => [`retry ${d.attempt} in ${num(d.delayMs)} ms`, d.status ? ` after HTTP ${d.status}` : " after a network error"],
  "model.result": (d) => [
    `${d.finishReason} · ${num(d.promptTokens)} in, ${num(d.outputTokens)} out · cache read ${num(d.cacheReadTokens)}, written ${num(d.cacheWriteTokens)} · ${num(d.latencyMs)} ms`,
    d.discarded ? " · discarded (asked again)" : "",
    d.error ? ` · error ${d.error}` : "",
  ],
  "tool.call": (d) => [`${d.slug}`, d.mutating ? " (mutating)" : "", d.server ? " (server tool)" : "", ` · ${d.callId}`],
  "tool.result": (d) => [`${d.slug} · `, d.refused ? "refused" : d.ok ? "ok" : "failed", d.uncertain ? " · uncertain" : "", ` · ${num(d.latencyMs)} ms · ${num(d.bytes)} bytes`, d.truncated ? " · truncated" : ""],
  "tool.gated": (d) => [`${d.slug} · ${d.policy}: ${d.reason}`],
  "tool.repair": (d) => [`${d.slugs.join(", ")}: ${d.errors.join("; ")}`],
  "approval.requested": (d) => [`${d.slug} waits for a person · ${d.reason || ""}`],
  "approval.resolved": (d) => [`${d.slug} ${d.granted ? "approved" : "denied"} by ${d.by}`],
  "turn.stopping": (d) => [`${d.reason}`, d.by ? ` by ${d.by}` : ""],
  "turn.end": (d) => [`${d.reason} after ${plural(d.steps, "step")} · ${num(d.durationMs)} ms · ${num(d.tokens && d.tokens.prompt)} in, ${num(d.tokens && d.tokens.output)} out, cache read ${num(d.tokens && d.tokens.cacheRead)}`],
  "handoff.start": (d) => [`to ${d.member} · session ${d.sessionKey}`, d.budget && d.budget.maxSteps !== undefined ? ` · at most ${d.budget.maxSteps} steps` : ""],
  "handoff.result": (d) => [`${d.member} · ${d.outcome}`, d.repaired ? " · after one repair" : "", ` · ${plural(d.steps, "step")} · ${num(d.tokens && d.tokens.prompt)} in, ${num(d.tokens && d.tokens.output)} out`, d.error ? ` · ${d.error.code}` : ""],
  "delivery.enqueued": (d) => [`to ${d.channelId}:${d.to} · part ${d.chunkIndex + 1}/${d.chunkTotal}`],
  "delivery.attempted": (d) => [`${d.channelId} · attempt ${d.attempt} · part ${d.chunkIndex + 1}/${d.chunkTotal}`],
  "delivery.sent": (d) => [`${d.channelId} · sent after ${d.attempts} attempts`, d.uncertain ? " · may show twice" : ""],
  "delivery.retry": (d) => [`${d.channelId} · ${d.code}: ${d.error} · again in ${num(d.delayMs)} ms`],
  "delivery.failed": (d) => [`${d.channelId} · ${d.code}: ${d.error}`, d.exhausted ? " · attempts used up" : ""],
  "delivery.uncertain": (d) => [`${d.channelId} · ${d.code || "outcome unknown"}`, d.resend ? " · resending" : " · not resent"],
  "session.note": (d) => [`notes: ${d.action}`],
  "session.cleared": () => ["history cleared"],
  "session.forked": (d) => [`forked from ${d.sourceAgentId}/${d.sourceSessionKey} at ${d.atTurnId}`],
};

const KIND = {
  "turn.end": "end", "turn.start": "start", "model.retry": "warn", "tool.gated": "warn",
  "approval.requested": "wait", "delivery.failed": "bad", "delivery.uncertain": "warn",
  "compaction.stage": "compact", "handoff.start": "handoff", "handoff.result": "handoff",
};

/** The events of one turn, live. `turn` is the turn resource (or the first fields of one). */
export class TurnView {
  constructor(agent, turn, { onFork } = {}) {
    this.agent = agent;
    this.turn = { ...turn };
    this.onFork = onFork;
    this.seen = new Set();
    this.events = []; // in log order, as rendered
    this.pending = [];
    this.loaded = false;
    this.loading = null;
    this.steps = new Map(); // stepId -> 1-based step number
    this.stream = null; // the text row being streamed into: {stepId, kind, el}
    this.list = h("ol", { class: "events", "aria-label": `events of turn ${turn.turnId}` });
    this.head = h("div", { class: "turn-head" });
    this.body = h("div", { class: "turn-body", hidden: true }, this.list);
    this.el = h("article", { class: "turn", dataset: { turnId: turn.turnId } }, this.head, this.body);
    this.renderHead();
  }

  /** The header: what was asked, how it ended, what it cost. Cheap: redrawn on its few changes. */
  renderHead() {
    const t = this.turn;
    const open = !this.body.hidden;
    const toggle = h("button", { class: "toggle", "aria-expanded": String(open), onclick: () => this.toggle() },
      open ? "▾" : "▸", h("span", { class: "visually-hidden" }, open ? " hide events" : " show events"));
    const actions = h("span", { class: "actions" },
      link(route("agents", this.agent, "turns", t.turnId, "context"), "What the model saw"),
      this.onFork && t.status && t.status !== "running"
        ? h("button", { class: "link", onclick: () => this.onFork(t) }, "Fork here")
        : null);
    replace(this.head, toggle,
      status(t.status || "running"),
      h("span", { class: "input", title: t.input || "" }, brief(t.input || "", 160)),
      h("span", { class: "figures" }, t.steps !== undefined ? `${plural(t.steps, "step")} · ` : "",
        t.costUsd !== undefined ? h("span", { class: "cost", title: t.costReason || "by the node's price table" }, usd(t.costUsd), " · ") : "",
        t.promptTokens !== undefined ? `${num(t.promptTokens)} in / ${num(t.outputTokens)} out · ` : "",
        t.cacheReadTokens ? `cache read ${num(t.cacheReadTokens)} · ` : "",
        t.startedAt ? clock(t.startedAt) : ""),
      actions,
    );
    if (t.errorCode) {
      this.head.append(h("div", { class: "turn-error", role: "note" }, h("strong", {}, t.errorCode), " ", t.errorMessage || "", t.errorHint ? h("div", { class: "hint" }, "Hint: ", t.errorHint) : null));
    }
  }

  toggle(force) {
    const open = force === undefined ? this.body.hidden : force;
    this.body.hidden = !open;
    this.renderHead();
    return open ? this.load() : Promise.resolve();
  }

  /** Read the turn's stored events (once), then whatever came live meanwhile. */
  load() {
    if (this.loaded) return Promise.resolve();
    this.loading ??= (async () => {
      await turnEvents(this.agent, this.turn.turnId, (events) => {
        this.render(events);
        if (!this.painted) {
          this.painted = true;
          performance.mark("dispach.timeline.painted"); // the first events are on the page
        }
      });
      this.loaded = true;
      const waiting = this.pending;
      this.pending = [];
      this.render(waiting);
    })().catch((err) => {
      this.loading = null;
      this.list.append(h("li", { class: "row bad" }, `could not read the events: ${err.message}`));
    });
    return this.loading;
  }

  /** A live event of this turn: rendered now if the stored ones are in, else after them. */
  live(event) {
    this.note(event);
    if (this.loaded) this.render([event]);
    else this.pending.push(event);
  }

  /** Take a turn started live: nothing stored to read before it. */
  startLive() {
    this.loaded = true;
  }

  /** What an event changes in the header. */
  note(event) {
    const d = event.data;
    if (event.type === "turn.end") {
      Object.assign(this.turn, { status: d.reason, steps: d.steps, durationMs: d.durationMs,
        promptTokens: d.tokens?.prompt, outputTokens: d.tokens?.output, cacheReadTokens: d.tokens?.cacheRead,
        errorCode: d.error?.code, errorMessage: d.error?.message, errorHint: d.error?.hint });
      this.renderHead();
      // Its cost is the turn resource's (priced by the node), not the event's: read it once.
      api(agentPath(this.agent, "turns", enc(this.turn.turnId))).then((r) => {
        Object.assign(this.turn, { costUsd: r.costUsd, costReason: r.costReason });
        this.renderHead();
      }).catch(() => {});
    } else if (event.type === "approval.requested" && this.turn.status === "running") {
      this.head.querySelector(".status").textContent = "awaiting_approval";
    } else if (event.type === "approval.resolved") {
      this.head.querySelector(".status").textContent = this.turn.status || "running";
    }
  }

  render(events) {
    const fragment = document.createDocumentFragment();
    for (const event of events) {
      if (this.seen.has(event.id)) continue;
      this.seen.add(event.id);
      this.events.push(event);
      const row = this.row(event);
      if (row) fragment.append(row);
    }
    if (fragment.childNodes.length) this.list.append(fragment);
  }

  step(event) {
    if (!event.stepId) return "";
    if (!this.steps.has(event.stepId)) this.steps.set(event.stepId, this.steps.size + 1);
    return this.steps.get(event.stepId);
  }

  row(event) {
    const step = this.step(event);
    if (event.type === "model.chunk") return this.chunk(event, step);
    this.stream = null;
    const summarise = SUMMARY[event.type];
    const d = event.data;
    const li = h("li", { class: `row ${KIND[event.type] || ""}`, dataset: { id: event.id, type: event.type, cursor: event.cursor } },
      h("time", { datetime: event.ts, class: "ts" }, clock(event.ts)),
      h("span", { class: "step", title: "step" }, step ? `s${step}` : ""),
      h("span", { class: "type" }, event.type),
      h("span", { class: "what" }, summarise ? summarise(d) : brief(d)));
    if (event.type === "turn.end" && d.error) {
      li.append(h("div", { class: "turn-error" }, h("strong", {}, d.error.code), " ", d.error.message, d.error.hint ? h("div", { class: "hint" }, "Hint: ", d.error.hint) : null));
    }
    if (event.type === "tool.call" || event.type === "tool.result") li.append(this.details(event));
    else if (event.type === "model.result" && d.text) li.append(h("details", {}, h("summary", {}, "text"), h("div", { class: "text" }, d.text)));
    else if (event.type === "handoff.start") li.append(this.child(d.member, d.turnId, "the member's turn"));
    else if (event.type === "handoff.result" && d.turnIds) {
      // The first member turn hangs under handoff.start; a repair round's turn, here.
      for (const turnId of d.turnIds.slice(1)) li.append(this.child(d.member, turnId, "the repair round"));
      if (d.error) li.append(h("div", { class: "turn-error" }, h("strong", {}, d.error.code), " ", d.error.message, d.error.hint ? h("div", { class: "hint" }, "Hint: ", d.error.hint) : null));
    }
    else if (event.type === "approval.requested") li.append(h("div", {}, link(withQuery(route("approvals"), { agent: this.agent }), "Answer it in Approvals")));
    else if (!summarise) li.append(h("details", {}, h("summary", {}, "data"), pretty(d)));
    return li;
  }

  /** A member's turn of a handoff, folded: its own timeline, read (with its turn resource)
   * when it is opened. */
  child(agent, turnId, label) {
    const view = new TurnView(agent, { turnId, input: `${label} (${agent})` });
    const open = view.toggle.bind(view);
    view.toggle = (force) => {
      const shown = open(force);
      if (!view.resourceRead) {
        view.resourceRead = true;
        api(agentPath(agent, "turns", enc(turnId))).then((resource) => {
          Object.assign(view.turn, resource, { input: `${label} (${agent}): ${resource.input || ""}` });
          view.renderHead();
        }).catch(() => { view.resourceRead = false; });
      }
      return shown;
    };
    return h("div", { class: "handoff-child", dataset: { childTurnId: turnId } }, view.el);
  }

  /** Text as it is written: a step's chunks of one kind go into one block, span by span. */
  chunk(event, step) {
    const kind = event.data.kind || "text";
    const span = h("span", { dataset: { id: event.id, type: event.type, cursor: event.cursor } }, event.data.delta);
    if (this.stream && this.stream.stepId === event.stepId && this.stream.kind === kind) {
      this.stream.el.append(span);
      return null;
    }
    const text = h("div", { class: kind === "reasoning" ? "text thinking" : "text", "aria-live": "polite" }, span);
    this.stream = { stepId: event.stepId, kind, el: text };
    return h("li", { class: "row chunks", dataset: { type: "model.chunk", kind } },
      h("time", { datetime: event.ts, class: "ts" }, clock(event.ts)),
      h("span", { class: "step" }, step ? `s${step}` : ""),
      h("span", { class: "type" }, kind === "reasoning" ? "thinking" : "text"),
      text);
  }

  /** A tool call's arguments or a result's output: read from the log when folded open (they
   * never come on the stream; the node shows them only to a caller with a bearer token). */
  details(event) {
    const body = h("div", { class: "detail" }, h("span", { class: "muted" }, "loading…"));
    const details = h("details", {}, h("summary", {}, event.type === "tool.call" ? "arguments" : "output"), body);
    details.addEventListener("toggle", async () => {
      if (!details.open || details.dataset.read) return;
      details.dataset.read = "1";
      try {
        const found = await this.privateEvent(event);
        const key = event.type === "tool.call" ? "args" : "output";
        const value = found && found.data[key];
        replace(body, value === undefined ? h("span", { class: "muted" }, "not shown to this caller") : pretty(value));
      } catch (err) {
        replace(body, h("span", { class: "muted" }, `${err.code || "error"}: ${err.message}`));
        delete details.dataset.read;
      }
    });
    return details;
  }

  async privateEvent(event) {
    const at = this.events.findIndex((e) => e.id === event.id);
    const after = at > 0 ? this.events[at - 1].cursor : "";
    const page = await api(agentPath(this.agent, "turns", enc(this.turn.turnId), "events") + query({ after, limit: 50, private: "true" }));
    return page.events.find((e) => e.id === event.id);
  }
}
