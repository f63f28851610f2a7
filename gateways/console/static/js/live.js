// A live stream of the log (SSE, /v1/events) that survives everything a browser tab meets: the
// node restarting (EventSource reconnects with Last-Event-ID by itself) and its stream token
// expiring (the node answers 401, EventSource gives up; we ask for a fresh token and reopen
// after the last cursor we saw). Events may come twice across a reopen: readers dedupe by id.

import { query, streamToken } from "./api.js";

let typesPromise = null;

/** Every event type the node knows (served by the console from the node's own catalogue). */
export function eventTypes() {
  typesPromise ??= fetch("types.json").then((r) => r.json());
  return typesPromise;
}

export class Live {
  /**
   * grant: the stream token's body ({agentId, sessionKey?}); params: the query of /v1/events
   * besides st and after; onEvent(envelope); onControl(type, data); onState("live"|"reconnecting").
   */
  constructor({ grant, params, onEvent, onControl = () => {}, onState = () => {} }) {
    Object.assign(this, { grant, params, onEvent, onControl, onState });
    this.cursor = null;
    this.source = null;
    this.closed = false;
    this.retries = 0;
    this.subscribed = new Promise((resolve) => { this.onSubscribed = resolve; });
  }

  async start(after) {
    this.cursor = after || null;
    await this.open();
  }

  async open() {
    if (this.closed) return;
    let st;
    try {
      st = await streamToken(this.grant);
    } catch (err) {
      this.onState("failed", err);
      if (err.status === 401 || err.status === 403 || err.status === 404) return;
      return this.later();
    }
    if (this.closed) return;
    const types = await eventTypes();
    const url = "/v1/events" + query({ ...this.params, after: this.cursor || "", st });
    const source = new EventSource(url);
    this.source = source;
    const onFrame = (frame) => {
      const envelope = JSON.parse(frame.data);
      if (frame.lastEventId) this.cursor = frame.lastEventId;
      this.retries = 0;
      this.onEvent(envelope);
    };
    for (const type of types) source.addEventListener(type, onFrame);
    for (const control of ["stream.subscribed", "stream.replay", "stream.ended"]) {
      source.addEventListener(control, (frame) => {
        this.onState("live");
        this.onSubscribed();
        this.onControl(control, JSON.parse(frame.data));
      });
    }
    source.onopen = () => this.onState("live");
    source.onerror = () => {
      if (this.closed) return;
      if (source.readyState === EventSource.CLOSED) {
        // Refused (an expired token, a node that is not ready): a fresh token, after our cursor.
        source.close();
        this.later();
      } else {
        this.onState("reconnecting");
      }
    };
  }

  later() {
    this.onState("reconnecting");
    const delay = Math.min(5000, 250 * 2 ** this.retries++);
    this.timer = setTimeout(() => this.open(), delay);
  }

  close() {
    this.closed = true;
    clearTimeout(this.timer);
    if (this.source) this.source.close();
  }
}
