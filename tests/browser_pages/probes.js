// What a web page can do to a Dispach node on loopback. tests/test_browser.py calls these with
// page.evaluate and judges the node by what it let through (the log, the tool's marker file).
"use strict";

// A "simple" cross-site request: no preflight, the page cannot read the answer, but it is sent.
window.plainPost = async (url, body) => {
  try {
    await fetch(url, { method: "POST", mode: "no-cors", headers: { "Content-Type": "text/plain" }, body });
    return "sent";
  } catch (e) {
    return "failed: " + e;
  }
};

window.beacon = (url, body) => navigator.sendBeacon(url, body);

// A form post into the hidden iframe (the page stays). With enctype text/plain and a field named
// '{"text":"record","x":"' valued '"}' the body is JSON: {"text":"record","x":"="}.
window.submitForm = (url, enctype, fields) => {
  const form = document.createElement("form");
  form.method = "POST";
  form.action = url;
  form.enctype = enctype;
  form.target = "sink";
  for (const [name, value] of Object.entries(fields)) {
    const input = document.createElement("input");
    input.type = "hidden";
    input.name = name;
    input.value = value;
    form.appendChild(input);
  }
  document.body.appendChild(form);
  form.submit();
};

// Open a WebSocket, send `frame` once open, collect what comes back for `waitMs`.
window.openSocket = (url, frame, waitMs) =>
  new Promise((resolve) => {
    const seen = { opened: false, error: false, closeCode: null, frames: [] };
    const ws = new WebSocket(url);
    const done = () => resolve(seen);
    ws.onopen = () => {
      seen.opened = true;
      if (frame !== null) ws.send(JSON.stringify(frame));
    };
    ws.onmessage = (m) => seen.frames.push(JSON.parse(m.data));
    ws.onerror = () => { seen.error = true; };
    ws.onclose = (e) => { seen.closeCode = e.code; done(); };
    setTimeout(() => { ws.close(); done(); }, waitMs);
  });

// A CORS fetch: the answer if the browser lets the page read it, else the error it raised.
window.corsFetch = async (url, init) => {
  try {
    const r = await fetch(url, init);
    return { status: r.status, contentType: r.headers.get("content-type"), body: await r.text() };
  } catch (e) {
    return { error: String(e) };
  }
};

// An EventSource on `url`, listening to every event type in `types`; everything it sees goes to
// window.sse.log with the time (ms since the epoch).
window.sse = { log: [], source: null };
window.listen = (url, types) => {
  const log = window.sse.log;
  const source = new EventSource(url);
  window.sse.source = source;
  source.onopen = () => log.push({ kind: "open", t: Date.now() });
  source.onerror = () => log.push({ kind: "error", state: source.readyState, t: Date.now() });
  for (const type of types) {
    source.addEventListener(type, (m) =>
      log.push({ kind: "event", type, id: m.lastEventId, data: JSON.parse(m.data), t: Date.now() }));
  }
};
