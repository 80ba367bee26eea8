// The clover denoising playground: one prompt through one to three decoding modes, each streamed
// with the server's provisional events (stream_options.provisional, docs/serving.md) and drawn step
// by step. Plain browser JavaScript: no build step, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const API = "v1/"; // relative: the page works under any prefix the server is mounted at
const MAX_MODES = 3;
const KEY_STORE = "clover.apiKey"; // sessionStorage only
// The numeric and choice options the page sends, with the server's defaults filled in from
// GET /v1/clover/modes. `max_tokens` is the request field for the library's max_new_tokens.
const FIELDS = ["max_tokens", "temperature", "block_size", "threshold", "policy", "fallback", "factor",
  "low_threshold", "entropy_budget", "sub_block", "draft_length", "seed"];
const OPTION_OF = { max_tokens: "max_new_tokens" };
const PAGE_DEFAULTS = { max_tokens: 64, temperature: 0 }; // the playground's own: short and greedy
const MASK = "░"; // as the terminal view and the timeline (clover.viz.MASK_GLYPH)
// viridis (perceptually uniform and colour-blind safe), the anchors clover.viz uses
const VIRIDIS = [[0.267, 0.005, 0.329], [0.283, 0.141, 0.458], [0.254, 0.265, 0.530], [0.207, 0.372, 0.553],
  [0.164, 0.471, 0.558], [0.128, 0.567, 0.551], [0.135, 0.659, 0.518], [0.267, 0.749, 0.441],
  [0.478, 0.821, 0.318], [0.741, 0.873, 0.150], [0.993, 0.906, 0.144]];

let info = null; // GET /v1/clover/modes
let runs = []; // the panels of the current comparison
let controller = null; // aborts the current comparison

// ------------------------------------------------------------------------------------- colours
function stepRgb(step, maxStep) {
  const frac = maxStep <= 1 ? 0 : (Math.min(Math.max(step, 1), maxStep) - 1) / (maxStep - 1);
  const pos = frac * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(pos), VIRIDIS.length - 2);
  const t = pos - i;
  return VIRIDIS[i].map((a, k) => a + (VIRIDIS[i + 1][k] - a) * t);
}

function paint(el, step, maxStep) {
  const rgb = stepRgb(step, maxStep);
  el.style.backgroundColor = `rgb(${rgb.map((c) => Math.round(c * 255)).join(",")})`;
  el.style.color = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 0.55 ? "#000" : "#fff";
}

function drawScale(maxStep) {
  const scale = $("scale");
  scale.textContent = "";
  const n = Math.min(maxStep, 12);
  for (let k = 0; k < n; k++) {
    const cell = document.createElement("span");
    paint(cell, 1 + Math.round((k * (maxStep - 1)) / Math.max(1, n - 1)), maxStep);
    scale.appendChild(cell);
  }
  $("scale-max").textContent = String(maxStep);
}

// --------------------------------------------------------------------------------- the server
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error) return `${resp.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status} ${resp.statusText}`;
}

function askForKey(why) {
  $("auth").open = true;
  status(why);
  $("api_key").focus();
}

async function loadModes() {
  const resp = await fetch(API + "clover/modes", { headers: headers() });
  if (resp.status === 401) {
    askForKey("This server needs an API key: enter it under “API key”.");
    return false;
  }
  if (!resp.ok) {
    status(`Cannot read the modes: ${await errorText(resp)}`);
    return false;
  }
  info = await resp.json();
  $("model").textContent = `model ${info.model} · context ${info.max_model_len} tokens`;
  // a chat model opens on the chat endpoint (the URL's kind= still chooses)
  document.querySelector(`input[name="kind"][value="${info.chat ? "chat" : "completion"}"]`).checked = true;
  buildControls();
  return true;
}

function buildControls() {
  const box = $("modes");
  box.querySelectorAll("label").forEach((l) => l.remove());
  for (const m of info.data) {
    const label = document.createElement("label");
    const input = document.createElement("input");
    Object.assign(input, { type: "checkbox", name: "mode", value: m.id, disabled: !m.available });
    input.addEventListener("change", limitModes);
    label.title = m.available ? m.summary : `${m.summary} (needs a model with a mask token)`;
    label.append(input, ` ${m.id}`);
    box.appendChild(label);
  }
  for (const name of FIELDS) {
    const spec = info.options[OPTION_OF[name] || name];
    const el = $(name);
    if (!spec || !el) continue;
    if (spec.choices && el.tagName === "SELECT") {
      el.textContent = "";
      for (const c of spec.choices) el.appendChild(new Option(c, c));
    }
    if (spec.ge !== undefined) el.min = spec.ge;
    if (spec.le !== undefined) el.max = spec.le;
    if (spec.doc) el.title = spec.doc;
    const value = name in PAGE_DEFAULTS ? PAGE_DEFAULTS[name] : spec.default;
    el.value = value === null || value === undefined ? "" : String(value);
    el.dataset.default = el.value;
  }
  setModes([info.default]);
}

function checkedModes() {
  return [...document.querySelectorAll('input[name="mode"]:checked')].map((i) => i.value);
}

function setModes(names) {
  const known = new Set(info.data.filter((m) => m.available).map((m) => m.id));
  const want = names.filter((n) => known.has(n)).slice(0, MAX_MODES);
  if (!want.length) want.push(info.default);
  document.querySelectorAll('input[name="mode"]').forEach((i) => { i.checked = want.includes(i.value); });
  limitModes();
}

function limitModes() {
  const full = checkedModes().length >= MAX_MODES;
  for (const input of document.querySelectorAll('input[name="mode"]')) {
    const m = info.data.find((x) => x.id === input.value);
    input.disabled = !m.available || (full && !input.checked);
  }
}

// ------------------------------------------------------------------------ settings and the URL
function settings() {
  const s = { prompt: $("prompt").value, kind: document.querySelector('input[name="kind"]:checked').value,
    modes: checkedModes(), pace: Number($("pace").value), seq: $("seq").checked };
  for (const name of FIELDS) s[name] = $(name).value.trim();
  return s;
}

function requestBody(s, mode) {
  const body = { mode, stream: true, stream_options: { provisional: true } };
  if (s.kind === "chat") body.messages = [{ role: "user", content: s.prompt }];
  else body.prompt = s.prompt;
  for (const name of FIELDS) {
    const raw = s[name];
    if (raw === "") continue; // the server's default (the model's, for block size and threshold)
    body[name] = $(name).tagName === "SELECT" ? raw : Number(raw);
  }
  return body;
}

function shareUrl(autorun) {
  const s = settings();
  const q = new URLSearchParams();
  q.set("prompt", s.prompt);
  q.set("mode", s.modes.join(","));
  if (s.kind !== (info.chat ? "chat" : "completion")) q.set("kind", s.kind);
  for (const name of FIELDS) if (s[name] !== $(name).dataset.default) q.set(name, s[name]);
  if (s.pace) q.set("pace", String(s.pace));
  if (s.seq) q.set("seq", "1");
  if (autorun) q.set("autorun", "1");
  return `${location.origin}${location.pathname}?${q}`;
}

function applyUrl() {
  const q = new URLSearchParams(location.search);
  if (q.has("prompt")) $("prompt").value = q.get("prompt");
  if (q.get("kind") === "chat" || q.get("kind") === "completion") {
    document.querySelector(`input[name="kind"][value="${q.get("kind")}"]`).checked = true;
  }
  if (q.has("mode")) setModes(q.get("mode").split(",").map((x) => x.trim()));
  for (const name of FIELDS) if (q.has(name)) $(name).value = q.get(name);
  if (q.has("pace")) $("pace").value = q.get("pace");
  $("seq").checked = q.get("seq") === "1";
  return q.get("autorun") === "1";
}

// ---------------------------------------------------------------------------------- one run
class Run {
  constructor(mode, s) {
    this.mode = mode;
    this.meta = info.data.find((m) => m.id === mode);
    this.blockSize = Number(s.block_size) || info.options.block_size.default || 32;
    this.pace = s.pace;
    this.queue = [];
    this.draining = false;
    this.text = "";
    this.tokens = 0;
    this.group = 0; // AR / speculative: which forward's shade
    this.state = "waiting";
    this.el = document.createElement("article");
    this.el.className = "run";
    this.el.dataset.mode = mode;
    this.el.innerHTML = `
      <header><h2></h2><span class="badge" hidden></span><span class="state"></span></header>
      <dl class="stats">
        <div><dt>forwards</dt><dd data-stat="forwards">–</dd></div>
        <div><dt>tokens / forward</dt><dd data-stat="tokens_per_forward">–</dd></div>
        <div><dt>tokens / s</dt><dd data-stat="tokens_per_second">–</dd></div>
        <div><dt>time to first token</dt><dd data-stat="ttft">–</dd></div>
        <div><dt>tokens</dt><dd data-stat="tokens">0</dd></div>
        <div><dt>forced steps</dt><dd data-stat="forced_steps">–</dd></div>
      </dl>
      <p class="where muted"></p>
      <div class="live" tabindex="0" role="group"><div class="committed"></div><div class="block" aria-hidden="true"></div></div>
      <h3>Text</h3>
      <pre class="text"></pre>
      <p class="error" role="alert" hidden></p>`;
    this.el.querySelector("h2").textContent = mode;
    this.el.querySelector(".live").setAttribute("aria-label", `${mode}: tokens coloured by the denoise step that decoded them`);
    this.committed = this.el.querySelector(".committed");
    this.block = this.el.querySelector(".block");
    this.setState("waiting");
  }

  setState(state) {
    this.state = state;
    this.el.dataset.state = state;
    this.el.querySelector(".state").textContent = state;
  }

  stat(name, value) {
    this.el.querySelector(`[data-stat="${name}"]`).textContent = value;
  }

  fail(message) {
    const p = this.el.querySelector(".error");
    p.textContent = message;
    p.hidden = false;
    this.setState("error");
  }

  async start(s, signal) {
    this.setState("running");
    const t0 = performance.now();
    const path = s.kind === "chat" ? "chat/completions" : "completions";
    let resp;
    try {
      resp = await fetch(API + path, { method: "POST", headers: headers(), body: JSON.stringify(requestBody(s, this.mode)), signal });
    } catch (e) {
      this.fail(signal.aborted ? "stopped" : `cannot reach the server: ${e.message}`);
      return;
    }
    if (!resp.ok) {
      if (resp.status === 401) askForKey("The server refused the API key: enter it under “API key”.");
      this.fail(await errorText(resp));
      return;
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") { this.push({ kind: "end" }); continue; }
            const chunk = JSON.parse(data);
            if (chunk.error) { this.push({ kind: "error", message: chunk.error.message }); continue; }
            if (this.ttft === undefined && (chunk.choices.some((c) => (c.text || (c.delta && c.delta.content)))
                || (chunk.clover && chunk.clover.event === "commit"))) {
              this.ttft = performance.now() - t0;
              this.stat("ttft", `${Math.round(this.ttft)} ms`);
            }
            this.push({ kind: "chunk", chunk });
          }
        }
      }
    } catch (e) {
      this.push({ kind: "error", message: signal.aborted ? "stopped" : `the stream broke: ${e.message}` });
    }
    await this.finished;
  }

  // Events are drawn in arrival order; with a replay pace, each denoise step (and each commit)
  // holds the view for `pace` ms, so fast decoding can still be watched.
  push(ev) {
    this.queue.push(ev);
    if (!this.draining) {
      this.draining = true;
      this.finished = this.drain();
    }
  }

  async drain() {
    while (this.queue.length) {
      const ev = this.queue.shift();
      const drawn = this.handle(ev);
      if (drawn && this.pace) await new Promise((r) => setTimeout(r, this.pace));
      else if (drawn && this.queue.length > 64) await new Promise((r) => requestAnimationFrame(r));
    }
    this.draining = false;
  }

  handle(ev) {
    if (ev.kind === "end") {
      if (this.state === "running") this.setState("done");
      this.block.textContent = "";
      this.el.querySelector(".where").textContent = "";
      return false;
    }
    if (ev.kind === "error") { this.fail(ev.message); return false; }
    const chunk = ev.chunk;
    for (const c of chunk.choices) {
      const piece = c.text !== undefined ? c.text : (c.delta && c.delta.content) || "";
      if (piece) {
        this.text += piece;
        this.el.querySelector(".text").textContent = this.text;
      }
      if (c.finish_reason) this.finishReason = c.finish_reason;
    }
    const x = chunk.clover;
    if (!x) return false;
    if (x.event === "provisional") { this.drawBlock(x); return true; }
    if (x.event === "commit") { this.commit(x); return true; }
    if (x.event === "done") this.done(x);
    return false;
  }

  drawBlock(x) {
    const frag = document.createDocumentFragment();
    x.token_ids.forEach((id, j) => {
      if (id === null) {
        const span = document.createElement("span");
        span.className = "tok mask";
        span.textContent = MASK;
        frag.appendChild(span);
      } else {
        appendToken(frag, x.pieces[j], (span) => {
          paint(span, x.steps[j], this.blockSize);
          span.title = `block ${x.block} · position ${j} · step ${x.steps[j]}`;
        });
      }
    });
    this.block.replaceChildren(frag);
    const masked = x.token_ids.filter((t) => t === null).length;
    this.el.querySelector(".where").textContent = `block ${x.block} · step ${x.step} · ${masked} masked`;
    this.follow();
  }

  commit(x) {
    const byStep = this.meta.threshold_commit;
    const frag = document.createDocumentFragment();
    this.group += 1;
    x.token_ids.forEach((id, j) => {
      appendToken(frag, x.pieces[j], (span) => {
        if (byStep) {
          paint(span, x.steps[j], this.blockSize);
          span.title = `step ${x.steps[j]}${x.forced[j] ? " · forced" : ""}`;
        } else {
          span.classList.add("plain");
          if (this.group % 2) span.classList.add("alt");
          span.title = `forward ${this.group}`;
        }
        if (x.forced[j]) span.classList.add("forced");
      });
    });
    this.committed.appendChild(frag);
    this.block.textContent = "";
    this.tokens += x.token_ids.length;
    this.stat("tokens", String(this.tokens));
    this.follow();
  }

  done(x) {
    const st = x.stats;
    this.stats = st;
    this.stat("forwards", String(st.forwards));
    this.stat("tokens", String(st.tokens));
    this.stat("tokens_per_forward", st.tokens_per_forward.toFixed(2));
    this.stat("tokens_per_second", st.tokens_per_second.toFixed(1));
    this.stat("forced_steps", this.meta.threshold_commit ? String(st.forced_steps) : "–");
  }

  follow() { // committed blocks scroll up: the current block stays in sight
    const live = this.el.querySelector(".live");
    live.scrollTop = live.scrollHeight;
  }

  badge(ok, reference) {
    const b = this.el.querySelector(".badge");
    b.hidden = false;
    b.classList.toggle("same", ok);
    b.classList.toggle("differs", !ok);
    b.textContent = ok ? `✓ same text as ${reference}` : `✗ differs from ${reference}`;
  }
}

function appendToken(parent, piece, style) {
  const span = document.createElement("span");
  span.className = "tok";
  let shown = piece === null || piece === undefined ? "" : piece;
  shown = shown.replace(/\t/g, "⇥").replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g, "·");
  const newline = shown.includes("\n");
  span.textContent = shown.replace(/\n/g, "↵") || "·";
  style(span);
  parent.appendChild(span);
  if (newline) parent.appendChild(document.createElement("br"));
}

// ------------------------------------------------------------------------------- comparisons
function status(message) { $("status").textContent = message; }

async function runAll() {
  if (!info && !(await loadModes())) return;
  const s = settings();
  if (!s.prompt.trim()) { status("Write a prompt first."); $("prompt").focus(); return; }
  if (!s.modes.length) { status("Pick at least one mode."); return; }
  stop();
  history.replaceState(null, "", shareUrl(false));
  const box = $("runs");
  box.textContent = "";
  box.dataset.count = String(s.modes.length);
  runs = s.modes.map((m) => new Run(m, s));
  runs.forEach((r) => box.appendChild(r.el));
  drawScale(runs[0].blockSize);
  controller = new AbortController();
  const signal = controller.signal;
  $("run").disabled = true;
  $("stop").disabled = false;
  status(`Running ${s.modes.join(", ")}…`);
  if (s.seq) for (const r of runs) await r.start(s, signal);
  else await Promise.all(runs.map((r) => r.start(s, signal)));
  await Promise.all(runs.map((r) => r.finished));
  await referenceBadges(s, signal);
  $("run").disabled = false;
  $("stop").disabled = true;
  controller = null;
  const done = runs.filter((r) => r.state === "done");
  status(done.map((r) => `${r.mode}: ${r.stats ? `${r.stats.tokens} tokens in ${r.stats.forwards} forwards` : "done"}`).join("; ")
    + (done.length < runs.length ? ` (${runs.length - done.length} did not finish)` : ""));
}

// A lossless mode (speculative: AR; naive: diffusion) shows whether its greedy text equals its
// reference mode's: from the reference's own panel, or else one plain request for it.
async function referenceBadges(s, signal) {
  if (Number(s.temperature) !== 0) return;
  for (const r of runs) {
    const ref = r.meta.reference;
    if (!ref || r.state !== "done") continue;
    let text = null;
    const panel = runs.find((x) => x.mode === ref);
    if (panel) text = panel.state === "done" ? panel.text : null;
    else {
      const body = requestBody(s, ref);
      delete body.stream;
      delete body.stream_options;
      try {
        const resp = await fetch(API + (s.kind === "chat" ? "chat/completions" : "completions"),
          { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
        if (resp.ok) {
          const out = await resp.json();
          text = s.kind === "chat" ? out.choices[0].message.content : out.choices[0].text;
        }
      } catch (e) { /* stopped */ }
    }
    if (text !== null) r.badge(text === r.text, ref);
  }
}

function stop() {
  if (controller) controller.abort();
}

async function share() {
  const url = shareUrl(true);
  const link = $("link");
  link.value = url;
  link.hidden = false;
  try {
    await navigator.clipboard.writeText(url);
    status("Link copied: it runs this prompt and these settings when opened.");
  } catch (e) {
    link.focus();
    link.select();
    status("Copy the selected link (Ctrl+C): it runs this prompt and these settings when opened.");
  }
}

// --------------------------------------------------------------------------------------- start
async function init() {
  $("form").addEventListener("submit", (e) => { e.preventDefault(); runAll(); });
  $("stop").addEventListener("click", stop);
  $("share").addEventListener("click", share);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); runAll(); }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && controller) { e.preventDefault(); stop(); } });
  const key = $("api_key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", async () => {
    if (key.value) sessionStorage.setItem(KEY_STORE, key.value);
    else sessionStorage.removeItem(KEY_STORE);
    if (!info && (await loadModes())) { applyUrl(); status("Connected."); }
  });
  drawScale(32);
  if (!(await loadModes())) return;
  const autorun = applyUrl();
  drawScale(Number($("block_size").value) || 32);
  if (autorun) runAll();
  else $("prompt").focus();
}

init();
