// The page's live channel (see ui/live.py): poll <root>/cbp/live with one short request at a time, queue the
// frames it answers and draw them apart from the fetch loop (Plotly.react), with the counters, pace and load
// lines and the streaming reply. In slow motion and while paused the server answers the steps one by one and the
// page plays every one in order; at full speed it draws only the newest. No connection is held between polls,
// so many tabs of one browser share its six connections per host. Hover text goes to a line above the panels
// (#cbp-hover), never over the cells it describes.
(() => {
  const me = document.currentScript;
  const REFRESH = Math.max(0.05, parseFloat((me && me.dataset.refresh) || "0.2"));
  const HIDDEN_REFRESH = 1.0; // a background tab polls once a second (browsers throttle it anyway)
  const WAIT_AFTER_CLICK = 0.8; // seconds the server may hold the poll after a pacing click, for the new step
  const base = new URL(".", window.location.href);
  // for tests and bench/page_latency.py: frames (answers), lastStep, lastDrawn (key), history of draws
  // [[ms since navigation start, step drawn]], timings of the last draws, hold(on) to stop the script
  const st = { key: null, after: null, sid: null, busy: false, again: false, timer: null, committed: new Set(),
    drawn: {}, history: [], timings: [], queue: [], drawing: false, held: false, template: null, wait: 0,
    last: null, frames: 0, marks: { script: performance.now() } };
  window.cbpLive = st;

  const $ = (id) => document.getElementById(id);
  const session = () => {
    const el = document.querySelector("[data-cbp-session]");
    return el ? el.dataset.cbpSession || "" : "";
  };
  const esc = (v) => String(v === undefined || v === null ? "" : v)
    .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");

  function schedule(seconds) {
    clearTimeout(st.timer);
    if (!st.held) st.timer = setTimeout(poll, seconds * 1000);
  }

  function pollSoon() { schedule(0.01); }
  window.cbpPoll = pollSoon; // the page's events call it once they have run (ui/layout.py: .then(js=...))
  st.hold = (on) => { st.held = !!on; if (st.held) clearTimeout(st.timer); else pollSoon(); };

  // ------------------------------------------------------------------ hover: one line above the panels
  function hoverText(pt) {
    const d = pt.data || {};
    const tpl = String(d.hovertemplate || "").replace(/<extra>[\s\S]*?<\/extra>/g, "");
    if (!tpl || d.hoverinfo === "skip") return "";
    let cd = pt.customdata;
    if (cd === undefined && d.customdata && Array.isArray(pt.pointNumber)) {
      const row = d.customdata[pt.pointNumber[0]];
      cd = row ? row[pt.pointNumber[1]] : undefined;
    }
    return tpl.replace(/%\{([^}]+)\}/g, (_, k) => {
      const m = /^customdata\[(\d+)\]$/.exec(k);
      if (m) return esc(cd ? cd[+m[1]] : "");
      return esc(k === "x" ? pt.x : k === "y" ? pt.y : k === "text" ? pt.text : "");
    }).replace(/<br>/g, " · ");
  }

  function hoverLine(html) {
    const el = $("cbp-hover");
    if (el && el.innerHTML !== html) el.innerHTML = html;
  }

  // ------------------------------------------------------------------ drawing
  function draw(name, fig) {
    const host = $(name);
    if (!host || !fig || !window.Plotly) return;
    let div = host.querySelector(".cbp-plot");
    if (!div) {
      div = document.createElement("div");
      div.className = "cbp-plot";
      host.replaceChildren(div);
    }
    if (st.template && fig.layout && !fig.layout.template) fig.layout.template = st.template;
    window.Plotly.react(div, fig.data, fig.layout, { displayModeBar: false, responsive: true });
    if (!div.cbpHover && div.on) {
      div.cbpHover = true;
      div.on("plotly_hover", (ev) => hoverLine(ev && ev.points && ev.points.length ? hoverText(ev.points[0]) : ""));
      div.on("plotly_unhover", () => hoverLine(""));
    }
    st.drawn[name] = performance.now();
  }

  function text(id, value, asHtml) {
    const el = $(id);
    if (!el || value === undefined) return;
    if (asHtml) { if (el.innerHTML !== value) el.innerHTML = value; }
    else if (el.textContent !== value) el.textContent = value;
  }

  function counters(list) {
    for (const c of list || []) {
      const el = $("counter-" + c.key);
      if (!el) continue;
      const v = el.querySelector(".cbp-value"), l = el.querySelector(".cbp-label");
      if (l && l.textContent !== c.label) l.textContent = c.label;
      if (v && v.textContent !== c.value) v.textContent = c.value;
    }
  }

  function reply(chat) {
    const box = $("live-reply");
    if (!box) return;
    if (!chat) { box.hidden = true; return; }
    box.hidden = false;
    box.dataset.state = chat.state || ""; // sent ... decoding, then finished, stopped or failed
    text("live-reply-title", chat.title);
    text("live-reply-text", chat.text);
    if (chat.final && !st.committed.has(chat.rid)) {
      st.committed.add(chat.rid);
      const btn = document.querySelector("#cbp-commit button, button#cbp-commit");
      if (btn) btn.click(); // its event writes the finished turn into the chatbot
    }
  }

  function lines(f) {
    text("pace-status", f.pace, true);
    text("mine", f.mine, true);
    text("load-status", f.load);
    counters(f.counters);
    reply(f.chat);
  }

  // each figure of the frame is drawn into the element of its name (ui/panel_table.py: one row per panel);
  // the first is timed apart (the slot occupancy: the panel the room watches)
  function render(f) {
    const t0 = performance.now();
    let t1 = t0;
    for (const [name, fig] of Object.entries(f.figs)) {
      if (fig) draw(name, fig);
      if (t1 === t0) t1 = performance.now();
    }
    lines(f);
    const t2 = performance.now();
    st.lastDrawn = f.key;
    st.last = f;
    st.history.push([t2, f.drawn]); // [ms since navigation start, step drawn]
    if (!st.marks.drawn) st.marks.drawn = t2;
    if (st.history.length > 4000) st.history.splice(0, 1000);
    st.timings.push({ step: f.drawn, occupancy: t1 - t0, blocks: t2 - t1, fetch: f.fetchMs, parse: f.parseMs,
      queued: t0 - f.arrived });
    if (st.timings.length > 500) st.timings.splice(0, 100);
  }

  // frames are drawn apart from the fetch loop: the next poll is on its way while one draws
  function pump() {
    if (st.drawing || !st.queue.length) return;
    st.drawing = true;
    setTimeout(() => {
      try {
        const every = st.queue[st.queue.length - 1].every;
        const f = every ? st.queue.shift() : st.queue.pop();
        if (!every) st.queue.length = 0; // full speed: only the newest counts
        render(f);
      } finally {
        st.drawing = false;
        if (st.queue.length) pump();
      }
    }, 0);
  }

  function take(f, fetchMs, parseMs) {
    st.frames += 1;
    st.lastStep = f.step;
    if (f.template) st.template = f.template;
    if (!f.figs) { lines(f); return; }
    st.key = f.key;
    st.after = f.drawn;
    f.fetchMs = fetchMs;
    f.parseMs = parseMs;
    f.arrived = performance.now();
    st.queue.push(f);
    pump();
  }

  // the first frame is asked for as soon as this script runs, while Gradio still builds the page
  function liveUrl(q) {
    const url = new URL("cbp/live", base);
    url.search = new URLSearchParams(q).toString();
    return url;
  }
  let early = fetch(liveUrl({ session: "", since: "", shown: "", figs: document.hidden ? 0 : 1, template: 1 }),
    { cache: "no-store" }).then((r) => (r.ok ? r.text() : null)).catch(() => null);

  async function poll() {
    if (st.held) return;
    if (window.Plotly && !st.marks.plotly) st.marks.plotly = performance.now();
    const first = document.querySelector(".cbp-panel:not([data-folded])"); // the live area's first panel
    if (first && !st.marks.panels) st.marks.panels = performance.now();
    // the page is still being built; a page without panels (remote mode's) needs no Plotly, only its session
    const panelsPage = !!document.querySelector(".cbp-panel");
    if (panelsPage ? !window.Plotly || !first : !session()) return schedule(0.05);
    if (!st.marks.ready) st.marks.ready = performance.now(); // plotly.js and the panels' place are there
    if (st.busy) { st.again = true; return; }
    st.busy = true;
    const sid = session();
    if (sid !== st.sid) { // the page's load event named this tab: ask for its own view (its request outlined)
      st.sid = sid;
      st.key = null;
    }
    // the folded panels (in accordions) this tab shows now: their figures are asked for only while open
    const open = [...document.querySelectorAll(".cbp-panel[data-folded]")].filter((el) => el.offsetParent !== null)
      .map((el) => el.id).join(",");
    if (open && open !== st.open) st.key = null; // an accordion just opened: ask for the figures again
    st.open = open;
    // a hidden tab, or one showing another tab of the page (Compare), asks for no figures (nothing is built or
    // drawn for it, and the browser's cores stay free); it catches up when the panels are shown again
    const shown = !document.hidden && !!first && first.offsetParent !== null;
    if (shown && !st.shown) st.key = null;
    st.shown = shown;
    const figs = shown ? 1 : 0;
    const q = { session: sid, since: st.key || "", shown: open, figs };
    if (st.after !== null) q.after = st.after;
    if (st.wait) { q.wait = st.wait; st.wait = 0; }
    if (!st.template) q.template = 1;
    let next = shown ? REFRESH : HIDDEN_REFRESH;
    try {
      const t0 = performance.now();
      let body = early && !sid ? await early : null;
      early = null;
      if (body === null) {
        const r = await fetch(liveUrl(q), { cache: "no-store" });
        body = r.ok ? await r.text() : null;
      }
      if (body !== null) {
        const t1 = performance.now();
        const f = JSON.parse(body);
        take(f, t1 - t0, performance.now() - t1);
        if (shown && f.refresh) next = f.refresh;
        if (f.behind > 0 && figs) next = 0; // steps not drawn yet: ask for the next one at once
      }
    } catch (e) {
      next = 1.0; // server restarting: try again soon
    }
    st.busy = false;
    if (st.again) { st.again = false; next = 0; }
    schedule(next);
  }

  // a person's action changes what the panels show: ask at once; after Step, Resume or a run-to, the server
  // holds that poll (at most WAIT_AFTER_CLICK s) until the engine has made the new step
  const WAITS = "#resume, #step, #next-handover, #next-reuse";
  document.addEventListener("click", (e) => {
    const t = e.target.closest && e.target.closest(`#pause, ${WAITS}, #send, #stop, #clear, #start-load, #stop-load, #cbp-commit, #talk-preset`);
    if (!t) return;
    if (t.matches(WAITS)) st.wait = WAIT_AFTER_CLICK;
    pollSoon();
  }, true);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) pollSoon(); });
  // a closed tab aborts its reply at once (its KV blocks return to the pool); the server's lease covers a crash
  window.addEventListener("pagehide", () => {
    const sid = session();
    if (sid && navigator.sendBeacon) navigator.sendBeacon(new URL("cbp/bye?session=" + encodeURIComponent(sid), base));
  });
  poll();
})();
