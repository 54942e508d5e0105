// The page's live channel (see ui/live.py): poll <root>/cbp/live a few times a second with one short request,
// draw the figures with Plotly.react, fill the counters, the pace and load lines, and the streaming reply.
// No connection is held between polls, so many tabs of one browser share its six connections per host.
(() => {
  const me = document.currentScript;
  const REFRESH = Math.max(0.05, parseFloat((me && me.dataset.refresh) || "0.2"));
  const HIDDEN_REFRESH = 1.0; // a background tab polls once a second (browsers throttle it anyway)
  const base = new URL(".", window.location.href);
  const st = { key: null, busy: false, again: false, timer: null, committed: new Set(), drawn: {}, history: [] };
  window.cbpLive = st; // for tests and bench/page_latency.py: frames, lastStep, lastDrawn, history of draws

  const $ = (id) => document.getElementById(id);
  const session = () => {
    const el = document.querySelector("[data-cbp-session]");
    return el ? el.dataset.cbpSession : null;
  };

  function schedule(seconds) {
    clearTimeout(st.timer);
    st.timer = setTimeout(poll, seconds * 1000);
  }

  function pollSoon() { schedule(0.01); }
  window.cbpPoll = pollSoon; // the page's events call it once they have run (ui/layout.py: .then(js=...))

  function draw(name, fig) {
    const host = $(name);
    if (!host || !fig || !window.Plotly) return;
    let div = host.querySelector(".cbp-plot");
    if (!div) {
      div = document.createElement("div");
      div.className = "cbp-plot";
      host.replaceChildren(div);
    }
    window.Plotly.react(div, fig.data, fig.layout, { displayModeBar: false, responsive: true });
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

  function render(f) {
    st.frames = (st.frames || 0) + 1;
    st.lastStep = f.step;
    if (f.figs) {
      draw("occupancy", f.figs.occupancy);
      draw("blockmap", f.figs.blocks);
      if (f.figs.rates) draw("rates", f.figs.rates);
      st.key = f.key;
      st.lastDrawn = f.key;
      const drawnStep = parseInt(String(f.key).replace(/^\(/, ""), 10); // the key starts with the last step drawn
      st.history.push([performance.now(), drawnStep]); // [ms since page load, step drawn]
      if (st.history.length > 4000) st.history.splice(0, 1000);
    }
    text("pace-status", f.pace, true);
    text("mine", f.mine, true);
    text("load-status", f.load);
    counters(f.counters);
    reply(f.chat);
  }

  async function poll() {
    const sid = session();
    // the page is still being built (a page without panels, remote mode's, needs no Plotly here)
    if (!sid || (!window.Plotly && document.querySelector(".cbp-panel"))) return schedule(0.05);
    if (st.busy) { st.again = true; return; }
    st.busy = true;
    const rates = $("rates");
    const wantRates = rates && rates.offsetParent !== null ? 1 : 0;
    if (wantRates && !st.ratesDrawn) st.key = null; // the accordion just opened: ask for the figures again
    st.ratesDrawn = wantRates;
    const url = new URL("cbp/live", base);
    // a hidden tab asks for no figures (nothing is built or drawn for it); it catches up when shown again
    const figs = document.hidden ? 0 : 1;
    url.search = new URLSearchParams({ session: sid, since: st.key || "", rates: wantRates, figs }).toString();
    let next = document.hidden ? HIDDEN_REFRESH : REFRESH;
    try {
      const r = await fetch(url, { cache: "no-store" });
      if (r.ok) {
        const f = await r.json();
        render(f);
        if (!document.hidden && f.refresh) next = f.refresh;
      }
    } catch (e) {
      next = 1.0; // server restarting: try again soon
    }
    st.busy = false;
    if (st.again) { st.again = false; next = 0; }
    schedule(next);
  }

  // a person's action changes what the panels show: ask at once, and once more when its event has run
  document.addEventListener("click", (e) => {
    if (e.target.closest && e.target.closest("#pause, #resume, #step, #send, #stop, #clear, #start-load, #stop-load, #cbp-commit")) {
      pollSoon();
      setTimeout(pollSoon, 150);
    }
  }, true);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) pollSoon(); });
  // a closed tab aborts its reply at once (its KV blocks return to the pool); the server's lease covers a crash
  window.addEventListener("pagehide", () => {
    const sid = session();
    if (sid && navigator.sendBeacon) navigator.sendBeacon(new URL("cbp/bye?session=" + encodeURIComponent(sid), base));
  });
  poll();
})();
