// Kiln dashboard: one framework-free page over the public HTTP API (no build step, no CDN).
// Every request goes through api()/authHeaders(); every text from the server is set with
// textContent (never parsed as HTML); the API key lives in sessionStorage only.
'use strict';

(() => {
  // ------------------------------------------------------------------ helpers

  const $ = (sel, root = document) => root.querySelector(sel);

  function h(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === 'class') node.className = value;
      else if (key === 'text') node.textContent = String(value);
      else if (key === 'dataset') Object.assign(node.dataset, value);
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else if (key in node && typeof value !== 'string') node[key] = value;
      else node.setAttribute(key, value === true ? '' : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const short = (hex, n = 12) => (typeof hex === 'string' && hex.length > n ? hex.slice(0, n) : hex || '');

  function fmtNum(x) {
    if (x === null || x === undefined || Number.isNaN(x)) return '–';
    const a = Math.abs(x);
    if (a >= 1000) return Math.round(x).toLocaleString('en-US');
    if (a >= 10) return x.toFixed(1);
    if (a === 0) return '0';
    return x.toPrecision(3);
  }

  function fmtDuration(s) {
    if (s === null || s === undefined) return '–';
    s = Math.max(0, s);
    if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ${Math.round(s % 60)} s`;
    const hrs = Math.floor(m / 60);
    if (hrs < 48) return `${hrs} h ${m % 60} min`;
    return `${Math.floor(hrs / 24)} d ${hrs % 24} h`;
  }

  function fmtBytes(b) {
    if (b === null || b === undefined) return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i += 1; }
    return `${i ? b.toFixed(1) : b} ${units[i]}`;
  }

  const fmtTime = (epochS) => (epochS ? new Date(epochS * 1000).toLocaleTimeString() : '–');
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  function show(node, text, cls) {
    if (!node) return;
    node.textContent = text || '';
    node.hidden = !text;
    if (cls) node.className = cls;
  }

  // ------------------------------------------------------------------ API access

  const KEY_STORE = 'kiln.apiKey';
  const apiKey = () => sessionStorage.getItem(KEY_STORE) || '';

  function authHeaders(extra) {
    const headers = { ...(extra || {}) };
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  class ApiError extends Error {
    constructor(status, error, body) {
      const e = error && typeof error === 'object' ? error : {};
      super(typeof e.message === 'string' && e.message ? e.message : `HTTP ${status}`);
      this.status = status;
      this.code = e.code || null;
      this.param = e.param || null;
      this.hint = e.hint || null;
      this.type = e.type || null;
      this.body = body;
    }
  }

  // The API's own words: message, then the parameter and hint it gave, then status and code.
  function formatError(err) {
    if (!(err instanceof ApiError)) return String(err && err.message ? err.message : err);
    const lines = [err.message];
    if (err.param) lines.push(`param: ${err.param}`);
    if (err.hint) lines.push(`hint: ${err.hint}`);
    const tag = [err.status || null, err.code].filter(Boolean).join(' ');
    if (tag) lines.push(`(${tag})`);
    return lines.join('\n');
  }

  function errorFromResponse(resp, text) {
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
    const error = body && body.error && typeof body.error === 'object'
      ? body.error : { message: `${resp.status} ${resp.statusText || ''}`.trim() };
    return new ApiError(resp.status, error, body);
  }

  function noteAuth(status, err) {
    const banner = $('#banner');
    if (status === 401) {
      show(banner, `This server needs an API key: enter it in the "API key" field above. The server said: ${err.message}`
        + (err.hint ? ` (${err.hint})` : ''));
    } else if (status && status < 400) {
      show(banner, '');
    }
  }

  async function api(method, path, body) {
    // POST/DELETE always carry Content-Type: application/json (the server refuses other types).
    const init = {
      method,
      headers: authHeaders(method === 'GET' ? {} : { 'Content-Type': 'application/json' }),
      credentials: 'same-origin',
      cache: 'no-store',
    };
    if (body !== undefined) init.body = JSON.stringify(body);
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, { message: `could not reach the server: ${e.message}`, code: 'network_error' });
    }
    const text = await resp.text();
    if (!resp.ok) {
      const err = errorFromResponse(resp, text);
      if (path !== '/health') noteAuth(resp.status, err);
      throw err;
    }
    if (path !== '/health') noteAuth(resp.status);
    let data = null;
    const type = resp.headers.get('content-type') || '';
    if (type.includes('json')) data = text ? JSON.parse(text) : null;
    return { data, text, headers: resp.headers, status: resp.status };
  }

  // GET path's JSON; on failure show the API's words in errorNode and rethrow (pollers back off).
  async function getOrShow(path, errorNode) {
    try {
      return (await api('GET', path)).data;
    } catch (err) {
      show(errorNode, formatError(err));
      throw err;
    }
  }

  // Repeats fn; the interval doubles after each failure (up to max) and resets on success.
  // fn may return a number: the delay to use next time (faster while something runs).
  class Poller {
    constructor(fn, interval = 1000, max = 15000) {
      this.fn = fn; this.interval = interval; this.max = max;
      this.delay = interval; this.running = false; this.timer = null; this.busy = false; this.again = false;
    }

    start() {
      if (this.running) return;
      this.running = true;
      this.delay = this.interval;
      this.tick();
    }

    stop() { this.running = false; clearTimeout(this.timer); }

    now() { if (this.running) { clearTimeout(this.timer); this.tick(); } }

    async tick() {
      if (this.busy) { this.again = true; return; }
      this.busy = true;
      let next = null; let failed = false;
      try { next = await this.fn(); } catch (e) { failed = true; }
      this.busy = false;
      if (!this.running) return;
      if (failed) this.delay = Math.min(this.max, this.delay * 2);
      else this.delay = typeof next === 'number' ? next : this.interval;
      if (this.again) { this.again = false; this.delay = 0; }
      const delay = document.hidden ? Math.max(this.delay, 5000) : this.delay;
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.tick(), delay);
    }
  }

  // ------------------------------------------------------------------ line chart (canvas)

  const COLORS = ['#b4471f', '#2a6fdb', '#1f7a3a', '#8a3ffc'];

  function drawChart(canvas, series, opts = {}) {
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
    }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const points = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
    canvas.dataset.points = String(points.length);
    ctx.font = '11px system-ui, sans-serif';
    ctx.fillStyle = '#6b6b70';
    if (!points.length) {
      ctx.textAlign = 'center';
      ctx.fillText(opts.empty || 'no data yet', width / 2, height / 2);
      return;
    }
    const pad = { l: 52, r: 12, t: 10, b: 22 };
    let xMin = opts.xMin ?? Math.min(...points.map((p) => p[0]));
    let xMax = opts.xMax ?? Math.max(...points.map((p) => p[0]));
    let yMin = Math.min(0, ...points.map((p) => p[1]));
    let yMax = Math.max(...points.map((p) => p[1]));
    if (xMax === xMin) { xMin -= 1; xMax += 1; }
    if (yMax === yMin) { yMax = yMin + (Math.abs(yMin) || 1); }
    yMax += (yMax - yMin) * 0.05;
    const X = (x) => pad.l + ((x - xMin) / (xMax - xMin)) * (width - pad.l - pad.r);
    const Y = (y) => height - pad.b - ((y - yMin) / (yMax - yMin)) * (height - pad.t - pad.b);
    ctx.strokeStyle = '#e6e6ea';
    ctx.lineWidth = 1;
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (let i = 0; i <= 4; i += 1) {
      const y = yMin + ((yMax - yMin) * i) / 4;
      ctx.beginPath(); ctx.moveTo(pad.l, Y(y)); ctx.lineTo(width - pad.r, Y(y)); ctx.stroke();
      ctx.fillText(fmtNum(y), pad.l - 6, Y(y));
    }
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    const xFormat = opts.xFormat || fmtNum;
    for (let i = 0; i <= 4; i += 1) {
      const x = xMin + ((xMax - xMin) * i) / 4;
      ctx.fillText(xFormat(x), X(x), height - pad.b + 5);
    }
    series.forEach((s, i) => {
      const pts = s.points.filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
      ctx.strokeStyle = s.color || COLORS[i % COLORS.length];
      ctx.fillStyle = ctx.strokeStyle;
      ctx.lineWidth = 2;
      ctx.beginPath();
      pts.forEach((p, j) => (j ? ctx.lineTo(X(p[0]), Y(p[1])) : ctx.moveTo(X(p[0]), Y(p[1]))));
      ctx.stroke();
      if (pts.length <= 60) pts.forEach((p) => { ctx.beginPath(); ctx.arc(X(p[0]), Y(p[1]), 2.5, 0, 2 * Math.PI); ctx.fill(); });
    });
  }

  // ------------------------------------------------------------------ status page

  const samples = []; // [{t (ms), total generated tokens}]
  let lastHealth = null;

  function parsePrometheus(text) {
    const out = {};
    for (const line of text.split('\n')) {
      if (!line || line.startsWith('#')) continue;
      const m = /^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const value = Number(m[3]);
      if (Number.isFinite(value)) out[m[1]] = (out[m[1]] || 0) + value;
    }
    return out;
  }

  function tokensPerSecond() {
    if (samples.length < 2) return null;
    const first = samples[0]; const last = samples[samples.length - 1];
    return last.t > first.t ? ((last.total - first.total) * 1000) / (last.t - first.t) : null;
  }

  function renderStatusCards() {
    const hl = lastHealth;
    const cards = $('#status-cards');
    if (!hl) return;
    const mem = hl.memory || {};
    const items = [
      ['health', hl.status === 'ok' ? 'ok' : `unavailable${hl.engine_error ? `: ${hl.engine_error}` : ''}`],
      ['model', hl.model],
      ['base_model_sha256', short(hl.base_model_sha256), hl.base_model_sha256],
      ['device', hl.device],
      ['dtype', hl.dtype],
      ['uptime', fmtDuration(hl.uptime_s)],
      ['active rows', `${hl.active_rows} / ${hl.max_running_rows ?? '?'}`],
      ['queue depth', hl.queued_rows],
      ['KV slots in use', `${hl.active_rows} / ${hl.max_running_rows ?? '?'} (${fmtBytes(mem.kv_cache_bytes)} allocated)`],
      ['tokens/s (last minute)', fmtNum(tokensPerSecond())],
      ['adapters serving', Object.keys(hl.adapters || {}).length],
      ['training', hl.training_attached ? 'attached' : 'off'],
      ['RSS', fmtBytes(mem.rss_bytes)],
    ];
    if (mem.accelerator_allocated_bytes !== undefined) items.push(['accelerator allocated', fmtBytes(mem.accelerator_allocated_bytes)]);
    const budget = hl.memory_budget; // memory admission: reservations of running jobs and served adapters
    if (budget) {
      const held = budget.reservations || [];
      items.push(['memory reserved',
        `${fmtBytes(budget.reserved_bytes)} in ${held.length} reservation${held.length === 1 ? '' : 's'}, ${budget.available_bytes < 0 ? '0 B' : fmtBytes(budget.available_bytes)} free of ${fmtBytes(budget.budget_bytes)}`,
        held.length ? held.map((r) => `${r.kind} ${r.owner}: ${fmtBytes(r.bytes)}`).join('\n') : 'no reservations']);
    }
    cards.replaceChildren(...items.map(([k, v, title]) => h('div', { class: 'card', dataset: { key: k } },
      h('div', { class: 'k', text: k }), h('div', { class: 'v', text: v ?? '–', title }))));
  }

  function renderHealthPill(ok, text) {
    const pill = $('#health-pill');
    pill.textContent = text;
    pill.className = `pill ${ok ? 'ok' : 'bad'}`;
  }

  async function showProfile() { // serving.profile: fixed at start-up, so read once
    try {
      const { data } = await api('GET', '/v1/config');
      const profile = (data.effective || {}).profile;
      if (profile) {
        const pill = $('#profile-pill');
        pill.textContent = profile;
        pill.title = profile === 'stable' ? 'serving.profile = stable: serving only (no training, no merges)'
          : 'serving.profile = experimental: serving, training and merges';
        pill.hidden = false;
      }
    } catch (e) { /* no key yet, or an old server: no pill */ }
  }

  async function pollHealth() {
    let data;
    try {
      data = (await api('GET', '/health')).data;
    } catch (err) {
      if (err.status === 503 && err.body && err.body.status) data = err.body; // the engine is down: body says why
      else { renderHealthPill(false, err.status ? `error ${err.status}` : 'unreachable'); show($('#status-error'), formatError(err)); throw err; }
    }
    lastHealth = data;
    renderHealthPill(data.status === 'ok', data.status === 'ok' ? 'healthy' : 'unavailable');
    show($('#status-error'), '');
  }

  async function pollMetrics() {
    const { text } = await api('GET', '/metrics');
    const metrics = parsePrometheus(text);
    const now = Date.now();
    samples.push({ t: now, total: metrics.kiln_generated_tokens_total || 0 });
    while (samples.length > 2 && samples[1].t < now - 60000) samples.shift();
  }

  function renderTpsChart() {
    const now = Date.now();
    const points = [];
    for (let i = 1; i < samples.length; i += 1) {
      const a = samples[i - 1]; const b = samples[i];
      if (b.t > a.t) points.push([(b.t - now) / 1000, ((b.total - a.total) * 1000) / (b.t - a.t)]);
    }
    drawChart($('#tps-chart'), [{ points }], { xMin: -60, xMax: 0, xFormat: (x) => `${Math.round(x)} s`, empty: 'collecting samples…' });
  }

  const SECRET_NAME = /(secret|password|passwd|credential|api_key$|token$)/i;

  async function loadConfig() {
    const { data } = await api('GET', '/v1/config');
    $('#config-file').textContent = `config file: ${data.config_file || '(none)'}`;
    const rows = Object.entries(data.settings || {}).map(([name, entry]) => {
      let value = entry && typeof entry === 'object' && 'value' in entry ? entry.value : entry;
      if (SECRET_NAME.test(name) && value) value = '(set; not shown)';
      return h('tr', {}, h('td', {}, h('code', { text: name })),
        h('td', { text: typeof value === 'object' ? JSON.stringify(value) : String(value) }),
        h('td', { text: entry && entry.source }));
    });
    $('#config-table tbody').replaceChildren(...rows);
  }

  const statusPoller = new Poller(async () => {
    await pollHealth();
    try { await pollMetrics(); } catch (e) { /* /metrics missing: no chart */ }
    if (currentPage === 'status') { renderStatusCards(); renderTpsChart(); }
    return currentPage === 'status' ? 1000 : 5000;
  }, 1000, 15000);

  // ------------------------------------------------------------------ models (chat picker)

  let models = [];

  async function refreshModels(select) {
    const { data } = await api('GET', '/v1/models');
    models = data.data || [];
    const picker = $('#chat-model');
    const previous = select || picker.value;
    picker.replaceChildren(...models.map((m, i) => h('option', {
      value: m.id,
      text: i === 0 && !m.revision ? `${m.id} (base)` : `${m.id} (adapter @ ${short(m.revision)})`,
    })));
    if (previous && models.some((m) => m.id === previous)) picker.value = previous;
  }

  // ------------------------------------------------------------------ chat page

  const chat = { messages: [], controller: null, correcting: null };

  function chatParams() {
    const maxTokens = Number($('#chat-max-tokens').value) || 64;
    const temperature = Number($('#chat-temperature').value);
    return { max_tokens: maxTokens, temperature: Number.isFinite(temperature) ? temperature : 0 };
  }

  function messageView(msg) {
    const text = h('div', { class: 'text', text: msg.content });
    const who = h('div', { class: 'who' }, h('span', { text: msg.role === 'user' ? 'you' : msg.model || 'assistant' }));
    const meta = h('span', { class: 'meta muted' });
    who.append(meta);
    const node = h('div', { class: `msg ${msg.role}` }, who, text);
    msg.node = node; msg.textNode = text; msg.metaNode = meta; msg.whoNode = who;
    return node;
  }

  function addMessage(msg) {
    chat.messages.push(msg);
    $('#chat-log').append(messageView(msg));
    return msg;
  }

  function setAnswerMeta(msg) {
    const rev = msg.revision === 'base' || !msg.revision ? 'base model' : `adapter revision ${short(msg.revision)}`;
    msg.metaNode.textContent = msg.revision === undefined ? 'streaming…' : `· ${rev}`;
    msg.metaNode.title = msg.revision || '';
    msg.node.dataset.revision = msg.revision || '';
    msg.node.dataset.model = msg.model;
  }

  // Streams one answer into msg over SSE; resolves when [DONE] arrives.
  async function streamAnswer(model, history, msg) {
    const controller = new AbortController();
    chat.controller = controller;
    $('#chat-stop').hidden = false;
    $('#chat-send').disabled = true;
    let chunks = 0;
    try {
      let resp;
      try {
        resp = await fetch('/v1/chat/completions', {
          method: 'POST',
          headers: authHeaders({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
          credentials: 'same-origin',
          body: JSON.stringify({ model, messages: history, stream: true, ...chatParams() }),
          signal: controller.signal,
        });
      } catch (e) {
        throw new ApiError(0, { message: `could not reach the server: ${e.message}`, code: 'network_error' });
      }
      if (!resp.ok) {
        const err = errorFromResponse(resp, await resp.text());
        noteAuth(resp.status, err);
        throw err;
      }
      msg.revision = resp.headers.get('x-kiln-adapter-revision') || '';
      setAnswerMeta(msg);
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = '';
      let done = false;
      const handle = (event) => {
        const data = event.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).replace(/^ /, '')).join('\n');
        if (!data) return;
        if (data === '[DONE]') { done = true; return; }
        const obj = JSON.parse(data);
        if (obj.error) throw new ApiError(200, obj.error, obj);
        for (const choice of obj.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            msg.content += piece;
            msg.textNode.textContent = msg.content;
            chunks += 1;
            msg.node.dataset.chunks = String(chunks);
          }
          if (choice.finish_reason) msg.node.dataset.finishReason = choice.finish_reason;
        }
      };
      while (!done) {
        const { value, done: ended } = await reader.read();
        if (ended) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, '\n');
        let cut;
        while (!done && (cut = buffer.indexOf('\n\n')) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          handle(event);
        }
      }
      if (done) reader.cancel().catch(() => {});
      msg.node.dataset.done = 'true';
      return msg;
    } finally {
      chat.controller = null;
      $('#chat-stop').hidden = true;
      $('#chat-send').disabled = false;
    }
  }

  function addCorrectButton(msg) {
    const button = h('button', { type: 'button', class: 'secondary correct', text: 'Correct this answer' });
    button.addEventListener('click', () => openCorrection(msg));
    msg.whoNode.append(button);
  }

  async function ask(model, history) {
    const msg = addMessage({ role: 'assistant', content: '', model });
    setAnswerMeta(msg);
    show($('#chat-error'), '');
    try {
      await streamAnswer(model, history, msg);
      addCorrectButton(msg);
    } catch (err) {
      msg.node.dataset.done = 'error';
      if (err.name === 'AbortError') { msg.metaNode.textContent = '· stopped'; addCorrectButton(msg); }
      else show($('#chat-error'), formatError(err));
    }
    return msg;
  }

  const wire = (upto) => chat.messages.slice(0, upto).filter((m) => m.role !== 'note')
    .map((m) => ({ role: m.role, content: m.content }));

  async function sendChat(ev) {
    ev.preventDefault();
    const input = $('#chat-input');
    const question = input.value.trim();
    if (!question || chat.controller) return;
    input.value = '';
    addMessage({ role: 'user', content: question });
    await ask($('#chat-model').value, wire(chat.messages.length));
  }

  function openCorrection(msg) {
    chat.correcting = msg;
    $('#correct-panel').hidden = false;
    $('#correct-text').value = msg.content;
    show($('#correct-error'), '');
    $('#correct-status').textContent = '';
    $('#correct-text').focus();
  }

  async function waitJob(id, onUpdate) {
    let delay = 150;
    for (;;) {
      let job;
      try {
        job = (await api('GET', `/v1/train/jobs/${encodeURIComponent(id)}`)).data;
        delay = Math.min(2000, delay * 1.5);
      } catch (err) {
        if (err.status && err.status < 500 && err.status !== 429) throw err;
        delay = Math.min(10000, delay * 2);
      }
      if (job) {
        onUpdate(job);
        if (['succeeded', 'failed', 'cancelled'].includes(job.state)) return job;
      }
      await sleep(delay);
    }
  }

  async function adapterExists(name) {
    const listed = (await api('GET', '/v1/adapters')).data;
    return ((listed && listed.data) || []).some((a) => a.name === name);
  }

  async function submitCorrection() {
    const target = chat.correcting;
    if (!target) return;
    const status = $('#correct-status');
    const errorNode = $('#correct-error');
    show(errorNode, '');
    const index = chat.messages.indexOf(target);
    const history = wire(index);
    const corrected = $('#correct-text').value;
    const adapter = $('#correct-adapter').value.trim();
    const body = { adapter, auto_load: true, examples: [{ messages: [...history, { role: 'assistant', content: corrected }] }] };
    if ($('#correct-scope').checked) body.scope = 'corrections'; // unchecked: a continued adapter keeps its own
    const button = $('#correct-submit');
    button.disabled = true;
    delete status.dataset.jobState;
    delete status.dataset.heldBack;
    try {
      // correcting an adapter that exists continues it: the job replays its stored corrections (docs/training.md)
      if (await adapterExists(adapter)) body.base_adapter = adapter;
      const job = (await api('POST', '/v1/train/sft', body)).data;
      status.dataset.jobId = job.id;
      status.textContent = `job ${job.id} queued`;
      const done = await waitJob(job.id, (j) => {
        status.dataset.jobState = j.state;
        status.textContent = `job ${j.id}: ${j.state}` + (j.step != null ? `, step ${j.step}/${j.total_steps ?? '?'}` : '')
          + (j.loss != null ? `, loss ${fmtNum(j.loss)}` : '');
      });
      if (done.state !== 'succeeded') {
        show(errorNode, `The correction job ${done.state}: ${done.error || '(no reason given)'}`);
        return;
      }
      const result = done.result || {};
      const report = result.report || {};
      status.dataset.revision = result.revision || '';
      status.dataset.learned = String(report.learned === true);
      if (result.held_back) { // the locality guard or the activation (quarantine, memory) did not serve it: say why
        status.dataset.heldBack = result.held_back.code;
        const guard = result.held_back.code.startsWith('locality_');
        status.textContent = `job ${done.id} published ${adapter} revision ${short(result.revision)}, but it is not `
          + `served: ${result.held_back.reason}. Load it by hand on the Adapters page`
          + (guard ? ', or correct with fewer steps.' : ' once that is resolved.');
        return;
      }
      const autoScope = result.locality && result.locality.auto_scope;
      status.textContent = `job ${done.id} succeeded: ${adapter} revision ${short(result.revision)}`
        + ` after ${report.steps ?? '?'} steps (final loss ${fmtNum(report.final_loss)})`
        + (report.learned === true ? '; the job reports the correction is reproduced' : '')
        + (autoScope ? `; it answers only questions like its corrections (unscoped it changed the model's other `
          + `answers: ${autoScope.reason}), the base model the rest` : '')
        + '. Asking again with the new adapter…';
      await refreshModels(adapter);
      // Prove it: the same question, now to the adapter.
      addMessage({ role: 'user', content: history.length ? history[history.length - 1].content : '' }).node.classList.add('proof-question');
      const answer = await ask(adapter, history);
      answer.node.classList.add('proof');
      const same = answer.content.trim() === corrected.trim();
      const fromNew = answer.revision === result.revision;
      status.textContent = `${adapter} revision ${short(result.revision)} answered`
        + (fromNew ? ' (the new revision)' : ` — but the answer came from revision ${short(answer.revision) || 'base'}`)
        + (same ? ': the answer matches the correction.' : ': the answer differs from the correction.');
      status.dataset.proof = same ? 'match' : 'differs';
      $('#correct-panel').hidden = false;
    } catch (err) {
      show(errorNode, formatError(err));
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------------ training page

  const curves = new Map(); // job id -> {loss: [[step, loss]], tps: [[step, tokens/s]]}
  let chartJobId = null;

  function track(job) {
    if (!job || job.step == null) return;
    let h0 = curves.get(job.id);
    if (!h0) { h0 = { loss: [], tps: [] }; curves.set(job.id, h0); }
    const last = h0.loss[h0.loss.length - 1];
    if (!last || last[0] < job.step) {
      if (job.loss != null) h0.loss.push([job.step, job.loss]);
      if (job.tokens_per_s != null) h0.tps.push([job.step, job.tokens_per_s]);
    }
    chartJobId = job.id;
  }

  function trackFinished(job) {
    const h0 = curves.get(job.id);
    const report = job.result && job.result.report;
    if (!h0 || !report) return;
    const last = h0.loss[h0.loss.length - 1];
    if (report.final_loss != null && (!last || last[0] < report.steps)) {
      h0.loss.push([report.steps, report.final_loss]);
      if (report.tokens_per_s != null) h0.tps.push([report.steps, report.tokens_per_s]);
    }
  }

  function cancelButton(job) {
    return h('button', {
      type: 'button', class: 'danger cancel', text: job.cancel_requested ? 'Stopping…' : 'Cancel', disabled: job.cancel_requested,
      onclick: async (ev) => {
        ev.target.disabled = true;
        try { await api('DELETE', `/v1/train/queue/${encodeURIComponent(job.id)}`); show($('#training-action-error'), ''); }
        catch (err) { show($('#training-action-error'), formatError(err)); ev.target.disabled = false; }
        trainingPoller.now();
      },
    });
  }

  // Serving's latency beside the running job (GET /v1/train/status `serving` and `pacer`; docs/latency.md).
  function servingLine(serving, pacer) {
    if (!serving) return null;
    const ms = (v) => (v == null ? '–' : `${fmtNum(v)} ms`);
    let text = `serving meanwhile (last ${fmtNum(serving.window_s)} s): inter-token p50 ${ms(serving.itl_p50_ms)}`
      + ` · p99 ${ms(serving.itl_p99_ms)} · first token p99 ${ms(serving.ttft_p99_ms)}`;
    if (pacer) {
      text += ` · longest training hold while chats waited ${ms(1000 * pacer.longest_busy_hold_s)}`
        + ` (budget ${pacer.max_hold_ms ? `${fmtNum(pacer.max_hold_ms)} ms` : 'whole steps'},`
        + ` serving share ${fmtNum(100 * pacer.serving_share)}%)`;
    }
    return h('div', { class: 'muted serving-latency', text });
  }

  function renderRunning(job, serving, pacer) {
    const box = $('#running-job');
    if (!job) { box.replaceChildren(h('p', { class: 'muted', text: 'No job is running.' })); return; }
    const pct = job.total_steps ? Math.min(100, (100 * (job.step || 0)) / job.total_steps) : 0;
    const bar = h('div', {});
    bar.style.width = `${pct}%`;
    box.replaceChildren(
      h('div', { class: 'row' },
        h('strong', { text: job.adapter }), h('span', { class: 'badge running', text: job.state }),
        h('code', { text: job.id }), h('span', { class: 'muted', text: job.kind }), cancelButton(job)),
      h('div', { class: 'progress', title: `${pct.toFixed(0)}%` }, bar),
      h('div', { class: 'muted', text: `step ${job.step ?? 0} / ${job.total_steps ?? '?'} · loss ${fmtNum(job.loss)} · `
        + `${fmtNum(job.tokens_per_s)} tokens/s · ETA ${fmtDuration(job.eta_s)}` }),
      servingLine(serving, pacer),
    );
    box.dataset.jobId = job.id;
  }

  function jobRow(job) {
    const report = (job.result && job.result.report) || {};
    return h('tr', { dataset: { jobId: job.id, state: job.state } },
      h('td', {}, h('code', { text: job.id })), h('td', { text: job.kind }), h('td', { text: job.adapter }),
      h('td', {}, h('span', { class: `badge ${job.state}`, text: job.state })),
      h('td', { text: report.steps ?? job.step ?? '–' }), h('td', { text: fmtNum(report.final_loss ?? job.loss) }),
      h('td', {}, h('code', { text: short(job.result && job.result.revision), title: job.result && job.result.revision })),
      h('td', {}, localityBadge(job.result && job.result.locality, job.result && job.result.held_back)),
      h('td', { class: 'error', text: job.error || '' }));
  }

  // A job's locality (docs/training.md, "Locality"): probe answers its adapter left unchanged, the mean
  // KL(base || adapter) and the degenerate answers in the tooltip; flagged when the locality guard held the
  // adapter back (or admitted it only by the job's override). Takes a job result's `locality` or a receipt
  // summary's.
  function localityBadge(loc, heldBack) {
    if (!loc || loc.measured === false) return '';
    const guard = loc.guard || {};
    if (loc.error || loc.unchanged_fraction == null) {
      return h('span', { class: 'badge bad locality', text: 'locality not measured', title: loc.error || '' });
    }
    const below = guard.admitted === false;
    const parts = [`${loc.unchanged}/${loc.probes} probe answers unchanged`, `KL ${fmtNum(loc.kl_mean)} nats/token`,
      `${loc.degenerate} degenerate (base: ${loc.base_degenerate})`];
    if (guard.override && guard.code) parts.push(`admitted by override despite ${guard.code}`);
    const auto = loc.auto_scope; // scope "auto" published it scoped: the base answers what its corrections do not ask
    if (auto) {
      parts.push(`scoped to its corrections: unscoped it kept ${auto.unscoped.unchanged}/${auto.unscoped.probes} `
        + `(${auto.reason})`);
    }
    if (heldBack) parts.push(`held back: ${heldBack.reason}`);
    else if (below) parts.push(`under the locality guard's thresholds (${guard.reason || guard.code})`);
    const cls = heldBack || below ? 'badge bad locality' : (guard.code ? 'badge kept locality' : 'badge locality');
    const label = heldBack ? 'held back · ' : (below ? 'below threshold · ' : (auto ? 'scoped · ' : ''));
    return h('span', { class: cls, dataset: { unchanged: String(loc.unchanged_fraction), heldBack: String(!!heldBack) },
      text: `${label}locality ${loc.unchanged}/${loc.probes}`, title: parts.join(' · ') });
  }

  function renderCharts() {
    const data = chartJobId && curves.get(chartJobId);
    drawChart($('#loss-chart'), [{ points: data ? data.loss : [] }], { empty: 'no running job yet' });
    drawChart($('#train-tps-chart'), [{ points: data ? data.tps : [], color: COLORS[1] }], { empty: 'no running job yet' });
    $('#chart-job').textContent = chartJobId ? `curves of ${chartJobId} (sampled while this page was open)` : '';
  }

  async function pollTraining() {
    const status = await getOrShow('/v1/train/status', $('#training-error'));
    if (!status.worker_alive) show($('#training-error'), 'the training worker is not running on this server');
    else show($('#training-error'), '');
    track(status.running);
    for (const job of status.recent || []) trackFinished(job);
    renderRunning(status.running, status.serving, status.pacer);
    $('#queue-max').textContent = `(${(status.queued || []).length} queued, at most ${status.queue_max})`;
    $('#queue-table tbody').replaceChildren(...(status.queued || []).map((job) => h('tr', { dataset: { jobId: job.id } },
      h('td', { text: job.queue_position ?? '' }), h('td', {}, h('code', { text: job.id })), h('td', { text: job.kind }),
      h('td', { text: job.adapter }), h('td', { text: fmtTime(job.created_at) }), h('td', {}, cancelButton(job)))));
    $('#recent-table tbody').replaceChildren(...(status.recent || []).map(jobRow));
    renderCharts();
    return status.running || (status.queued || []).length ? 400 : 2000;
  }

  const trainingPoller = new Poller(pollTraining, 2000, 15000);

  // Examples/groups as a JSON array, an object holding the array, one object, or JSONL.
  function parseRecords(text, key) {
    const trimmed = text.trim();
    if (!trimmed) throw new Error(`paste the ${key} (JSON or JSONL) or upload a file`);
    try {
      const value = JSON.parse(trimmed);
      if (Array.isArray(value)) return value;
      if (value && Array.isArray(value[key])) return value[key];
      return [value];
    } catch (e) {
      if (trimmed.startsWith('[')) throw new Error(`the ${key} are not valid JSON: ${e.message}`);
    }
    return trimmed.split('\n').map((line, i) => [line.trim(), i + 1]).filter(([line]) => line).map(([line, n]) => {
      try { return JSON.parse(line); } catch (e) { throw new Error(`line ${n} is not valid JSON: ${e.message}`); }
    });
  }

  function numberField(form, name) {
    const raw = form.elements[name] && form.elements[name].value.trim();
    return raw ? Number(raw) : undefined;
  }

  function formOutput(form) {
    return { error: form.querySelector('.error'), ok: form.querySelector('.ok') };
  }

  function trainingForm(form, kind, key, numeric) {
    form.elements.file.addEventListener('change', async () => {
      const file = form.elements.file.files[0];
      if (file) form.elements[key].value = await file.text();
    });
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const out = formOutput(form);
      show(out.error, ''); show(out.ok, '');
      const body = { adapter: form.elements.adapter.value.trim() };
      try { body[key] = parseRecords(form.elements[key].value, key); }
      catch (e) { show(out.error, `Could not read the ${key}: ${e.message}`); return; }
      for (const name of numeric) { const v = numberField(form, name); if (v !== undefined) body[name] = v; }
      for (const name of ['base_adapter', 'kl_estimator', 'teacher', 'loss']) {
        const field = form.elements[name];
        if (field && field.value.trim()) body[name] = field.value.trim();
      }
      body.auto_load = form.elements.auto_load.checked;
      const button = form.querySelector('button[type=submit]');
      button.disabled = true;
      try {
        const job = (await api('POST', `/v1/train/${kind}`, body)).data;
        show(out.ok, `queued ${job.id}` + (job.queue_position != null ? ` (queue position ${job.queue_position})` : ''));
        form.dataset.lastJob = job.id;
        trainingPoller.now();
      } catch (err) {
        show(out.error, formatError(err));
      } finally {
        button.disabled = false;
      }
    });
  }

  // ------------------------------------------------------------------ adapters page

  async function adapterAction(button, method, path, body) {
    button.disabled = true;
    try {
      await api(method, path, body);
      show($('#adapters-error'), '');
      await refreshModels().catch(() => {});
    } catch (err) {
      show($('#adapters-error'), formatError(err));
    }
    adaptersPoller.now();
  }

  async function downloadWithKey(ev) {
    if (!apiKey()) return; // a plain link works without a key
    ev.preventDefault();
    const link = ev.currentTarget;
    try {
      const resp = await fetch(link.getAttribute('href'), { headers: authHeaders(), credentials: 'same-origin' });
      if (!resp.ok) throw errorFromResponse(resp, await resp.text());
      const disposition = resp.headers.get('content-disposition') || '';
      const match = /filename="?([^";]+)"?/.exec(disposition);
      const url = URL.createObjectURL(await resp.blob());
      const a = h('a', { href: url, download: match ? match[1] : 'adapter.tar.gz' });
      document.body.append(a); a.click(); a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      show($('#adapters-error'), formatError(err));
    }
  }

  function adapterRow(a) {
    const name = encodeURIComponent(a.name);
    const actions = h('div', { class: 'actions' });
    const fresh = a.active && a.active_revision === a.revision;
    actions.append(h('button', {
      type: 'button', class: 'load', text: a.active ? (fresh ? 'Reload' : 'Load latest') : 'Load',
      onclick: (ev) => adapterAction(ev.target, 'POST', `/v1/adapters/${name}/load`),
    }));
    if (a.active) {
      actions.append(h('button', {
        type: 'button', class: 'secondary unload', text: 'Unload',
        onclick: (ev) => adapterAction(ev.target, 'POST', `/v1/adapters/${name}/unload`),
      }));
    }
    const isDefault = defaultAdapter && defaultAdapter.name === a.name;
    actions.append(h('button', {
      type: 'button', class: isDefault ? 'secondary clear-default' : 'secondary make-default',
      text: isDefault ? 'Clear default' : 'Make default',
      title: 'the default adapter answers requests that name the base model (pinned to one revision)',
      onclick: (ev) => (isDefault ? adapterAction(ev.target, 'DELETE', '/v1/adapters/default')
        : adapterAction(ev.target, 'PUT', '/v1/adapters/default', { name: a.name })),
    }));
    const download = h('a', { class: 'download', href: `/v1/adapters/${name}/download`, download: '', text: 'Download' });
    download.addEventListener('click', downloadWithKey);
    actions.append(download);
    const del = h('button', { type: 'button', class: 'danger delete', text: 'Delete' });
    del.addEventListener('click', () => {
      // Two-step confirmation inside the page (no native dialog).
      const confirmButton = h('button', {
        type: 'button', class: 'danger confirm-delete', text: `Delete ${a.name} and all its revisions`,
        onclick: (ev) => { confirmingUntil = 0; adapterAction(ev.target, 'DELETE', `/v1/adapters/${name}`); },
      });
      const keep = h('button', {
        type: 'button', class: 'secondary', text: 'Keep it', onclick: () => { confirmingUntil = 0; adaptersPoller.now(); },
      });
      actions.replaceChildren(confirmButton, keep);
      confirmingUntil = Date.now() + 15000; // do not redraw the table under the question for a while
    });
    actions.append(del);
    return h('tr', { dataset: { adapter: a.name, active: String(a.active) } },
      h('td', {}, h('strong', { text: a.name })),
      h('td', {}, h('code', { text: short(a.revision), title: a.revision })),
      h('td', { text: a.kind }),
      h('td', {}, h('code', { text: short(a.parent_revision) || '–', title: a.parent_revision || '' })),
      h('td', { text: fmtBytes(a.size_bytes) }),
      h('td', { text: a.created }),
      gateCell(a),
      h('td', {}, a.active ? h('span', { class: 'badge serving', text: `serving ${short(a.active_revision)}` })
        : h('span', { class: 'badge', text: 'stored' }),
        isDefault ? h('span', { class: `badge default ${defaultAdapter.serving ? 'serving' : 'bad'}`,
          text: `default ${short(defaultAdapter.revision)}${defaultAdapter.serving ? '' : ' (not served)'}`,
          title: 'requests naming the base model get this revision' }) : '',
        receiptBadge(a),
        localityBadge(a.receipt && a.receipt.verified ? a.receipt.locality : null),
        ...Object.entries(a.quarantined || {}).map(([rev, mark]) => h('span', {
          class: 'badge bad quarantined', text: `quarantined ${short(rev)}`,
          title: `${mark.reason} (since ${mark.at}); clear: POST /v1/adapters/{name}/quarantine/clear` }))),
      h('td', {}, actions));
  }

  // The revision's training receipt (kiln-receipt.json, checked by the server to bind to it): job and
  // teacher in the tooltip; one that does not bind is flagged. Uploads and merges have none.
  function receiptBadge(a) {
    const r = a.receipt;
    if (!r) return '';
    if (!r.verified) {
      return h('span', { class: 'badge bad receipt', text: 'receipt does not bind', title: r.error || '' });
    }
    const parts = [`job ${r.job_id}`];
    if (r.teacher_fingerprint) parts.push(`teacher ${short(r.teacher_fingerprint)}`);
    if (r.gate) parts.push(`gate ${r.gate}`);
    return h('span', { class: 'badge receipt', text: 'receipt',
      title: `${parts.join(' · ')}; GET /v1/adapters/${a.name}/receipt` });
  }

  let confirmingUntil = 0;

  // The gate verdict of the job that produced an adapter's revision, from the public API only:
  // GET /v1/train/status (recent jobs carry result.revision and result.post_eval), else the
  // revision's manifest (config.job_id, GET /v1/adapters/{name}) and GET /v1/train/jobs/{id}.
  // Known answers are kept per revision (a revision never changes); a job still gating is asked again.
  const gates = new Map(); // revision -> {state: 'gate'|'none'|'pending', gate?, job?, note}

  function noteJob(revision, job) {
    const result = job.result || {};
    if (result.post_eval) gates.set(revision, { state: 'gate', gate: result.post_eval, job: job.id });
    else if (TERMINAL.includes(job.state)) gates.set(revision, { state: 'none', job: job.id, note: `job ${job.id} had no post_eval` });
    else {
      const gateRun = job.progress && job.progress.post_eval && job.progress.post_eval.gate_run;
      gates.set(revision, { state: 'pending', job: job.id, gateRun, note: `job ${job.id} is ${job.state}` + (gateRun ? ' (gate running)' : '') });
    }
  }

  async function resolveGates(adapters) {
    const unknown = adapters.filter((a) => !gates.has(a.revision) || gates.get(a.revision).state === 'pending');
    if (!unknown.length) return;
    let recent = [];
    try {
      const status = (await api('GET', '/v1/train/status')).data;
      recent = [...(status.recent || []), ...(status.running ? [status.running] : [])];
    } catch (e) { recent = []; }
    for (const a of unknown.slice(0, 8)) {
      const job = recent.find((j) => j.result && j.result.revision === a.revision);
      if (job) { noteJob(a.revision, job); continue; }
      if (a.kind === 'merge' || a.kind === 'upload') { gates.set(a.revision, { state: 'none', note: `a ${a.kind}: no training job` }); continue; }
      try {
        const detail = (await api('GET', `/v1/adapters/${encodeURIComponent(a.name)}`)).data;
        const config = (detail.manifest && detail.manifest.config) || {};
        if (detail.revision !== a.revision) continue; // a newer revision arrived: next poll
        if (!config.job_id) { gates.set(a.revision, { state: 'none', note: 'the manifest names no training job' }); continue; }
        noteJob(a.revision, (await api('GET', `/v1/train/jobs/${encodeURIComponent(config.job_id)}`)).data);
      } catch (err) {
        gates.set(a.revision, { state: 'none', note: `verdict unknown: ${err.message}` });
      }
    }
  }

  function gateCell(a) {
    const g = gates.get(a.revision);
    if (!g || g.state !== 'gate') {
      return h('td', { class: 'gate-cell', dataset: { gate: g ? g.state : 'unknown' }, title: g ? g.note : '' }, '—');
    }
    const link = h('a', { href: g.gate.gate_run ? `#/evals/${g.gate.gate_run}` : '#/evals', title: `job ${g.job}: ${gateSummary(g.gate)}` },
      h('span', { class: `badge verdict ${VERDICT_CLASS[g.gate.verdict] || ''}`, text: g.gate.verdict }));
    return h('td', { class: 'gate-cell', dataset: { gate: g.gate.verdict, job: g.job } }, link);
  }

  let defaultAdapter = null; // GET /v1/adapters/default: {name, revision, serving, served_revision} or null

  async function pollAdapters() {
    if (Date.now() < confirmingUntil) return 1000;
    const data = await getOrShow('/v1/adapters', $('#adapters-error'));
    try { defaultAdapter = (await api('GET', '/v1/adapters/default')).data.default; } catch (e) { defaultAdapter = null; }
    await resolveGates(data.data || []);
    if (Date.now() < confirmingUntil) return 1000;
    const rows = (data.data || []).map(adapterRow);
    $('#adapters-table tbody').replaceChildren(...(rows.length ? rows
      : [h('tr', {}, h('td', { colspan: '9', class: 'muted', text: 'No adapters yet: train one on the Training page or from the chat playground.' }))]));
    return 3000;
  }

  const adaptersPoller = new Poller(pollAdapters, 3000, 30000);

  function mergeForm(form) {
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const out = formOutput(form);
      show(out.error, ''); show(out.ok, '');
      const adapters = form.elements.adapters.value.split(/[\n,]/).map((s) => s.trim()).filter(Boolean).map((entry) => {
        const [name, weight] = entry.split(/[\s:=]+/);
        return weight === undefined ? { name } : { name, weight: Number(weight) };
      });
      const body = { name: form.elements.name.value.trim(), method: form.elements.method.value, adapters };
      for (const name of ['density', 'rank']) { const v = numberField(form, name); if (v !== undefined) body[name] = v; }
      try {
        const merged = (await api('POST', '/v1/adapters/merge', body)).data;
        show(out.ok, `merged into ${merged.name} revision ${short(merged.revision)}`
          + ((merged.notes || []).length ? `\nnotes: ${merged.notes.join('; ')}` : ''));
        adaptersPoller.now();
      } catch (err) {
        show(out.error, formatError(err));
      }
    });
  }

  // ------------------------------------------------------------------ gate verdicts (evals page, adapters page)

  const GATE_FIELDS = [
    ['pairs', 'pairs (n)'], ['candidate_passed', 'candidate passed (k)'], ['baseline_passed', 'baseline passed'],
    ['both_passed', 'both passed'], ['both_failed', 'both failed'],
    ['candidate_only', 'discordant: candidate only (b)'], ['baseline_only', 'discordant: baseline only (c)'],
    ['p_value', 'sign-test p-value'], ['alpha', 'alpha'], ['candidate_accuracy', 'candidate accuracy'],
    ['baseline_accuracy', 'baseline accuracy'], ['wilson_lower', 'Wilson 95% lower bound'],
    ['min_accuracy', 'min_accuracy'], ['min_pairs', 'min_pairs'],
  ];
  const VERDICT_CLASS = { promoted: 'succeeded', kept: 'kept', inconclusive: 'kept', demoted: 'failed',
    regression: 'failed', error: 'failed' };

  const fmtStat = (x) => (typeof x === 'number' && !Number.isInteger(x) ? x.toPrecision(4) : String(x ?? '–'));

  function gateSummary(gate) {
    const n = gate && gate.numbers;
    if (!n) return gate ? `${gate.verdict}: ${gate.reason || ''}` : '';
    return `${gate.verdict}: ${n.pairs} pairs, b=${n.candidate_only} c=${n.baseline_only}, p=${fmtStat(n.p_value)}, `
      + `Wilson lower ${fmtStat(n.wilson_lower)} (min_accuracy ${n.min_accuracy})`;
  }

  // The verdict with every number it carries; links to the candidate and baseline runs when known.
  function gateView(gate, links) {
    const numbers = gate.numbers || null;
    const rows = numbers ? GATE_FIELDS.filter(([key]) => key in numbers).map(([key, label]) => h('tr', {},
      h('th', { text: label }), h('td', { dataset: { key, value: String(numbers[key]) }, text: fmtStat(numbers[key]) }))) : [];
    const runLinks = (links || []).filter(([, id]) => id).map(([label, id]) => h('a', { href: `#/evals/${id}`, class: 'run-link', text: `${label} ${id}` }));
    return h('div', { class: 'gate panel', dataset: { verdict: gate.verdict } },
      h('h2', {}, 'Gate verdict ', h('span', { class: `badge verdict ${VERDICT_CLASS[gate.verdict] || ''}`, text: gate.verdict }),
        h('small', { text: ` rule ${gate.rule || 'paired_wilson_v1'}` })),
      h('p', { class: 'reason', text: gate.reason || '' }),
      rows.length ? h('table', { class: 'grid numbers' }, h('tbody', {}, rows)) : h('p', { class: 'muted', text: 'No numbers (the gate did not evaluate).' }),
      runLinks.length ? h('div', { class: 'row' }, runLinks) : null);
  }

  // ------------------------------------------------------------------ evals page

  const TERMINAL = ['succeeded', 'failed', 'cancelled'];
  const evals = { runId: null, detailState: null, built: false };

  function targetText(t) {
    if (!t) return 'base';
    if (!t.adapter) return 'base';
    return t.revision ? `${t.adapter} @ ${short(t.revision)}` : t.adapter;
  }

  function runTarget(run) {
    const req = run.request || {};
    if (run.kind === 'gate') return `${targetText(req.candidate)} vs ${targetText(req.post_eval && req.post_eval.baseline)}`;
    if (run.kind === 'comparison') return (req.targets || []).map(targetText).join(', ');
    if (run.kind === 'replay') return `replay of ${req.run_id || '?'}`;
    return targetText(req.target) + (req.role ? ` (${req.role} of ${req.parent})` : '');
  }

  function runOutcome(run) {
    const r = run.result || {};
    if (r.gate) return gateSummary(r.gate);
    if (r.aggregate) return `${r.aggregate.passed}/${r.aggregate.examples} passed (accuracy ${fmtStat(r.aggregate.accuracy)})`;
    if (r.replay) return `replay ${r.replay.verdict}`;
    return run.error || '';
  }

  function buildEvals(box) {
    box.replaceChildren(
      h('div', { class: 'panel' }, h('h2', { text: 'Suites' }),
        h('table', { class: 'grid', id: 'evals-suites' }, h('thead', {}, h('tr', {},
          ['name', 'description', 'examples', 'scorers', 'aggregation'].map((c) => h('th', { text: c })))), h('tbody'))),
      h('div', { class: 'panel' }, h('h2', {}, 'Runs ', h('small', { text: '(newest first; click one for its results)' })),
        h('table', { class: 'grid clickable', id: 'evals-runs' }, h('thead', {}, h('tr', {},
          ['run', 'kind', 'suite', 'target', 'state', 'outcome', 'created'].map((c) => h('th', { text: c })))), h('tbody'))),
      h('div', { class: 'panel' }, h('h2', {}, 'Judgments ', h('small', { id: 'judgments-total' })),
        h('table', { class: 'grid', id: 'judgments' }, h('thead', {}, h('tr', {},
          ['prompt', 'A', 'B', 'preferred', 'author', 'recorded'].map((c) => h('th', { text: c })))), h('tbody'))),
      h('div', { id: 'eval-detail' }));
    evals.built = true;
  }

  function evalsUnavailable(box, err) {
    evals.built = false;
    if (err.status === 404 || err.status === 503) {
      box.replaceChildren(h('div', { class: 'unavailable' },
        h('p', { text: `Evals are not available on this server: GET /v1/evals/runs answered ${err.status}.` }),
        h('p', { class: 'muted', text: `The server said: ${err.message}` })));
      box.dataset.available = 'false';
    } else {
      box.replaceChildren(h('p', { class: 'error', text: formatError(err) }));
      box.dataset.available = 'error';
    }
  }

  async function pollEvals() {
    const box = $('#evals-body');
    let runs;
    try {
      runs = (await api('GET', '/v1/evals/runs')).data.data || [];
    } catch (err) {
      evalsUnavailable(box, err);
      throw err;
    }
    if (!evals.built) buildEvals(box);
    try {
      const suites = (await api('GET', '/v1/evals/suites')).data.data || [];
      $('#evals-suites tbody').replaceChildren(...(suites.length ? suites.map((s) => h('tr', { dataset: { suite: s.name } },
        h('td', {}, h('strong', { text: s.name })), h('td', { text: s.description || '' }), h('td', { text: s.examples }),
        h('td', { text: (s.scorers || []).join(', ') }), h('td', { text: s.aggregation })))
        : [h('tr', {}, h('td', { colspan: '5', class: 'muted', text: 'No suites yet: POST /v1/evals/suites or `kiln eval suites create`.' }))]));
      show($('#evals-error'), '');
    } catch (err) {
      show($('#evals-error'), `GET /v1/evals/suites: ${formatError(err)}`);
    }
    $('#evals-runs tbody').replaceChildren(...(runs.length ? runs.map((run) => h('tr', {
      class: run.id === evals.runId ? 'selected' : null,
      dataset: { runId: run.id, state: run.state, kind: run.kind },
      onclick: () => { location.hash = `#/evals/${run.id}`; },
    }, h('td', {}, h('a', { href: `#/evals/${run.id}` }, h('code', { text: run.id }))), h('td', { text: run.kind }),
    h('td', { text: (run.request && run.request.suite_name) || '' }), h('td', { text: runTarget(run) }),
    h('td', {}, h('span', { class: `badge ${run.state}`, text: run.state })), h('td', { text: runOutcome(run) }),
    h('td', { text: fmtTime(run.created_at) })))
      : [h('tr', {}, h('td', { colspan: '7', class: 'muted', text: 'No runs yet: POST /v1/evals/runs or `kiln eval run`.' }))]));
    await pollJudgments();
    box.dataset.available = 'true';
    if (evals.runId && !TERMINAL.includes(evals.detailState)) await showRun(evals.runId);
    return runs.some((r) => !TERMINAL.includes(r.state)) ? 1000 : 4000;
  }

  const JUDGMENTS_SHOWN = 10;
  const clip = (text, n = 80) => (text.length > n ? `${text.slice(0, n - 1)}…` : text);

  // The newest A/B judgments (GET /v1/judgments?order=desc); POST /v1/judgments/train turns them into a judge.
  async function pollJudgments() {
    let page;
    try {
      page = (await api('GET', `/v1/judgments?order=desc&limit=${JUDGMENTS_SHOWN}`)).data;
    } catch (err) {
      $('#judgments-total').textContent = `(GET /v1/judgments: ${formatError(err)})`;
      return;
    }
    $('#judgments-total').textContent = `(${page.total} recorded, newest first; POST /v1/judgments/train trains a judge)`;
    $('#judgments tbody').replaceChildren(...(page.data.length ? page.data.map((j) => h('tr', { dataset: { judgment: j.id, preferred: j.preferred } },
      h('td', { text: clip(j.prompt), title: j.prompt }), h('td', { text: clip(j.response_a), title: j.response_a }),
      h('td', { text: clip(j.response_b), title: j.response_b }), h('td', { class: 'preferred', text: j.preferred }),
      h('td', { text: j.author || '' }), h('td', { text: fmtTime(j.created_at) })))
      : [h('tr', {}, h('td', { colspan: '6', class: 'muted', text: 'No judgments yet: POST /v1/judgments records an A/B preference.' }))]));
  }

  const evalsPoller = new Poller(pollEvals, 4000, 30000);

  function exampleRows(run) {
    const result = run.result || {};
    const suiteExamples = ((run.request || {}).suite || {}).examples || [];
    return (result.examples || []).map((ex, i) => {
      const spec = suiteExamples[i] || {};
      const messages = spec.messages || [];
      const prompt = messages.length ? messages[messages.length - 1].content : '(prompt not recorded)';
      const samples = ex.samples || [];
      const completion = h('td', { class: 'completion' }, samples.map((sm, j) => h('div', {
        class: `sample ${sm.passed ? 'pass' : 'fail'}`, title: `seed ${sm.seed}, ${sm.tokens} tokens, finish ${sm.finish_reason}`,
        text: samples.length > 1 ? `[${j + 1}] ${sm.completion}` : sm.completion })));
      return h('tr', { dataset: { exampleId: ex.id, passed: String(ex.passed) } },
        h('td', {}, h('code', { text: ex.id })),
        h('td', { class: 'prompt', text: typeof prompt === 'string' ? prompt : JSON.stringify(prompt) }),
        h('td', { class: 'reference', text: spec.reference == null ? '' : String(spec.reference) }),
        completion,
        h('td', { class: 'score', text: fmtStat(ex.score) }),
        h('td', {}, h('span', { class: `badge ${ex.passed ? 'succeeded' : 'failed'}`, text: ex.passed ? 'pass' : 'fail' })));
    });
  }

  function aggregateCards(agg) {
    const items = [['accuracy', fmtStat(agg.accuracy)], ['passed', `${agg.passed} / ${agg.examples}`],
      ['mean_score', fmtStat(agg.mean_score)], ['wilson_lower_95', fmtStat(agg.wilson_lower_95)],
      ['aggregation', agg.aggregation], ['generation_s', fmtStat(agg.generation_s)]];
    return h('div', { class: 'cards', id: 'eval-aggregate' }, items.map(([k, v]) => h('div', { class: 'card', dataset: { key: k } },
      h('div', { class: 'k', text: k }), h('div', { class: 'v', text: v ?? '–' }))));
  }

  async function showRun(id) {
    const detail = $('#eval-detail');
    if (!detail) return;
    let run;
    try {
      run = (await api('GET', `/v1/evals/runs/${encodeURIComponent(id)}`)).data;
    } catch (err) {
      evals.detailState = 'error';
      detail.replaceChildren(h('p', { class: 'error', text: formatError(err) }));
      return;
    }
    if (evals.runId !== id) return; // another run was picked meanwhile
    evals.detailState = run.state;
    const result = run.result || {};
    const parts = [
      h('h2', {}, 'Run ', h('code', { text: run.id }), ' ', h('span', { class: `badge ${run.state}`, text: run.state })),
      h('p', { class: 'muted', text: `${run.kind} of suite ${(run.request && run.request.suite_name) || '?'} · ${runTarget(run)}`
        + ` · created ${fmtTime(run.created_at)}` + (run.finished_at ? ` · finished ${fmtTime(run.finished_at)}` : '') }),
    ];
    if (run.request && run.request.parent) parts.push(h('p', {}, 'Part of ', h('a', { href: `#/evals/${run.request.parent}`, text: run.request.parent })));
    if (run.error) parts.push(h('p', { class: 'error', text: run.error }));
    if (!TERMINAL.includes(run.state)) parts.push(h('p', { class: 'muted', text: `progress: ${JSON.stringify(run.progress || {})}` }));
    if (result.gate) parts.push(gateView(result.gate, [['candidate run', result.candidate_run], ['baseline run', result.baseline_run]]));
    if (result.aggregate) parts.push(aggregateCards(result.aggregate));
    if (result.aggregates) {
      parts.push(h('table', { class: 'grid', id: 'eval-comparison' }, h('thead', {}, h('tr', {},
        ['target', 'run', 'passed', 'accuracy', 'Wilson lower'].map((c) => h('th', { text: c })))),
      h('tbody', {}, result.aggregates.map((a) => h('tr', {}, h('td', { text: targetText(a.target) }),
        h('td', {}, h('a', { href: `#/evals/${a.run}`, text: a.run })), h('td', { text: `${a.passed}/${a.examples}` }),
        h('td', { text: fmtStat(a.accuracy) }), h('td', { text: fmtStat(a.wilson_lower_95) }))))));
    }
    if (result.replay) parts.push(h('pre', { class: 'replay', text: JSON.stringify(result.replay, null, 2) }));
    if (result.examples) {
      parts.push(h('table', { class: 'grid', id: 'eval-examples' }, h('thead', {}, h('tr', {},
        ['example', 'prompt', 'reference', 'completion', 'score', ''].map((c) => h('th', { text: c })))),
      h('tbody', {}, exampleRows(run))));
    }
    detail.replaceChildren(h('div', { class: 'panel' }, parts));
    detail.dataset.runId = run.id;
    detail.dataset.state = run.state;
  }

  function startEvals(arg) {
    evals.runId = arg || null;
    evals.detailState = null;
    const detail = $('#eval-detail');
    if (detail && !arg) { detail.replaceChildren(); delete detail.dataset.runId; }
    for (const row of document.querySelectorAll('#evals-runs tbody tr')) row.classList.toggle('selected', row.dataset.runId === arg);
    evalsPoller.start();
    evalsPoller.now();
  }

  // ------------------------------------------------------------------ teachers page

  let teachersConfirmAlias = null;

  // kiln-teacher-v1.<identity b64>.<sha256>: the digest at the end tells fingerprints apart.
  const shortFingerprint = (f) => (typeof f === 'string' ? short(f.slice(f.lastIndexOf('.') + 1)) : '');

  function teacherRow(t) {
    const alias = encodeURIComponent(t.alias);
    const actions = h('div', { class: 'actions' });
    const remove = h('button', { type: 'button', class: 'danger remove', text: 'Remove' });
    remove.addEventListener('click', () => {
      teachersConfirmAlias = t.alias;
      actions.replaceChildren(
        h('button', { type: 'button', class: 'danger confirm-remove', text: `Remove ${t.alias}`,
          onclick: async (ev) => {
            ev.target.disabled = true;
            teachersConfirmAlias = null;
            try { await api('DELETE', `/v1/teachers/${alias}`); show($('#teachers-error'), ''); }
            catch (err) { show($('#teachers-error'), formatError(err)); }
            await loadTeachers().catch(() => {});
          } }),
        h('button', { type: 'button', class: 'secondary', text: 'Keep it',
          onclick: () => { teachersConfirmAlias = null; loadTeachers().catch(() => {}); } }));
    });
    actions.append(remove);
    const status = `${t.status}${t.usable ? ' · usable' : ' · not usable'}${t.reason ? `: ${t.reason}` : ''}`;
    const provider = t.kind === 'local' ? 'this server' : (t.provider || '–');
    const model = t.kind === 'local' ? (t.adapter ? `adapter ${t.adapter}` : 'base model') : (t.model_id || '–');
    return h('tr', { dataset: { alias: t.alias, usable: String(t.usable) } },
      h('td', {}, h('strong', { text: t.alias })), h('td', { text: t.kind }), h('td', { text: provider }),
      h('td', { text: model }),
      h('td', {}, h('span', { class: `badge ${t.usable ? 'succeeded' : 'failed'}`, text: status })),
      h('td', {}, h('code', { class: 'fingerprint', text: shortFingerprint(t.fingerprint) || '–', title: t.fingerprint || '' })),
      h('td', {}, h('code', { class: 'identity', text: short(t.identity_revision) || '–', title: t.identity_revision || '' })),
      h('td', { text: fmtTime(t.registered_at) }),
      h('td', {}, actions));
  }

  async function loadTeachers() {
    const box = $('#teachers-body');
    const form = $('#teacher-form');
    let list;
    try {
      list = (await api('GET', '/v1/teachers')).data.data || [];
    } catch (err) {
      form.hidden = true;
      if (err.status === 404 || err.status === 503) {
        box.replaceChildren(h('div', { class: 'unavailable' },
          h('p', { text: `Teachers are not available on this server: GET /v1/teachers answered ${err.status}.` }),
          h('p', { class: 'muted', text: `The server said: ${err.message}` })));
        box.dataset.available = 'false';
      } else {
        box.replaceChildren(h('p', { class: 'error', text: formatError(err) }));
        box.dataset.available = 'error';
      }
      throw err;
    }
    if (teachersConfirmAlias && list.some((t) => t.alias === teachersConfirmAlias)) return; // a question is open
    box.replaceChildren(h('table', { class: 'grid', id: 'teachers-table' },
      h('thead', {}, h('tr', {}, ['alias', 'kind', 'provider', 'model', 'status', 'fingerprint', 'identity revision', 'registered', '']
        .map((c) => h('th', { text: c })))),
      h('tbody', {}, list.length ? list.map(teacherRow)
        : h('tr', {}, h('td', { colspan: '9', class: 'muted', text: 'No teachers registered yet.' })))));
    box.dataset.available = 'true';
    box.dataset.count = String(list.length);
    form.hidden = false;
  }

  function teacherForm(form) {
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const out = formOutput(form);
      show(out.error, ''); show(out.ok, '');
      const body = { alias: form.elements.alias.value.trim(), kind: 'local' };
      const adapter = form.elements.adapter.value.trim();
      if (adapter) body.adapter = adapter;
      const button = form.querySelector('button[type=submit]');
      button.disabled = true;
      show(out.ok, `probing ${body.alias}…`);
      try {
        const t = (await api('POST', '/v1/teachers', body)).data;
        show(out.ok, `registered ${t.alias}: ${t.status}, fingerprint ${shortFingerprint(t.fingerprint)}`);
        form.dataset.lastAlias = t.alias;
      } catch (err) {
        show(out.ok, '');
        show(out.error, formatError(err));
      } finally {
        button.disabled = false;
      }
      await loadTeachers().catch(() => {});
    });
  }

  // The OPD form's teacher picker: the registry's aliases (usable ones first).
  async function refreshTeacherOptions() {
    const select = $('#opd-form select[name=teacher]');
    const previous = select.value;
    let list;
    try {
      list = (await api('GET', '/v1/teachers')).data.data || [];
    } catch (err) {
      select.replaceChildren(h('option', { value: '', text: `(teachers unavailable: ${err.message})` }));
      return;
    }
    list.sort((a, b) => Number(b.usable) - Number(a.usable));
    select.replaceChildren(h('option', { value: '', text: list.length ? '(pick a teacher)' : '(no teachers registered)' }),
      ...list.map((t) => h('option', { value: t.alias, text: `${t.alias} (${t.kind}${t.usable ? '' : ', not usable'})` })));
    if (previous && list.some((t) => t.alias === previous)) select.value = previous;
    else if (list.some((t) => t.usable)) select.value = list[0].alias;
  }

  // ------------------------------------------------------------------ OpenEnv page

  function openenvRow(run) {
    const req = run.request || {};
    const p = run.progress || {};
    const r = run.returns;
    const terms = Object.entries(run.terminations || {}).filter(([, n]) => n).map(([k, n]) => `${k} ${n}`).join(', ');
    const job = run.training_job || {};
    const published = (job.result && job.result.revision) ? ` → ${job.result.adapter}@${short(job.result.revision)}` : '';
    const state = run.queue_position ? `${run.state} #${run.queue_position}` : run.state;
    return h('tr', { dataset: { runId: run.id, state: run.state } },
      h('td', {}, h('code', { text: run.id })),
      h('td', {}, h('span', { class: `badge ${run.state}`, text: state })),
      h('td', { text: (run.environment && (run.environment.name || run.environment.url)) || req.env_url || '' }),
      h('td', { class: 'episodes', text: `${p.episodes_done || 0}/${(req.groups || 0) * (req.group_size || 0)}` }),
      h('td', { class: 'returns', text: r ? `${fmtNum(r.mean)} (${fmtNum(r.min)} – ${fmtNum(r.max)})` : '–' }),
      h('td', { class: 'terminations', text: terms || '–' }),
      h('td', { class: 'job', text: job.id ? `${job.state}${published}` : '–' }),
      h('td', { class: 'artifacts', text: Object.keys(run.artifacts || {}).join(', ') || '–' }),
      h('td', { class: 'error-code', text: run.error ? run.error.code : '', title: run.error ? run.error.message : '' }),
      h('td', { text: fmtTime(run.created_at) }));
  }

  async function pollOpenenv() {
    const box = $('#openenv-body');
    let runs;
    try {
      runs = (await api('GET', '/v1/openenv/runs')).data.data || [];
    } catch (err) {
      box.replaceChildren(err.status === 404 || err.status === 503
        ? h('p', { class: 'unavailable', text: `OpenEnv runs are not available on this server: GET /v1/openenv/runs answered ${err.status}.` })
        : h('p', { class: 'error', text: formatError(err) }));
      box.dataset.available = err.status === 404 || err.status === 503 ? 'false' : 'error';
      throw err;
    }
    box.replaceChildren(h('table', { class: 'grid', id: 'openenv-runs' },
      h('thead', {}, h('tr', {}, ['run', 'state', 'environment', 'episodes', 'mean return (min – max)', 'terminations',
        'training', 'artifacts', 'error', 'created'].map((c) => h('th', { text: c })))),
      h('tbody', {}, runs.length ? runs.slice().reverse().map(openenvRow)
        : h('tr', {}, h('td', { colspan: '10', class: 'muted', text: 'No runs yet.' })))));
    box.dataset.available = 'true';
    box.dataset.count = String(runs.length);
    return runs.some((r) => !TERMINAL.includes(r.state)) ? 1000 : 5000;
  }

  const openenvPoller = new Poller(pollOpenenv, 5000, 30000);

  // ------------------------------------------------------------------ routing

  const PAGES = {
    status: { start: () => { statusPoller.now(); loadConfig().catch((err) => show($('#status-error'), formatError(err))); } },
    chat: { start: () => refreshModels().catch((err) => show($('#chat-error'), formatError(err))) },
    training: {
      start: () => { trainingPoller.start(); refreshTeacherOptions(); },
      stop: () => trainingPoller.stop(),
    },
    adapters: { start: () => adaptersPoller.start(), stop: () => adaptersPoller.stop() },
    evals: { start: startEvals, stop: () => evalsPoller.stop() },
    teachers: { start: () => loadTeachers().catch(() => {}) },
    openenv: { start: () => { openenvPoller.start(); openenvPoller.now(); }, stop: () => openenvPoller.stop() },
  };
  let currentPage = null;

  function route() {
    const [name, arg] = (location.hash.replace(/^#\/?/, '') || 'status').split('/');
    const page = PAGES[name] ? name : 'status';
    if (currentPage && currentPage !== page && PAGES[currentPage].stop) PAGES[currentPage].stop();
    currentPage = page;
    for (const section of document.querySelectorAll('.page')) section.hidden = section.id !== `page-${page}`;
    for (const link of document.querySelectorAll('#nav a')) link.classList.toggle('active', link.dataset.page === page);
    document.title = `Kiln · ${page}`;
    PAGES[page].start(page === name ? decodeURIComponent(arg || '') : '');
    document.body.dataset.page = page;
  }

  function init() {
    const keyInput = $('#api-key');
    keyInput.value = apiKey();
    keyInput.addEventListener('change', () => {
      const value = keyInput.value.trim();
      if (value) sessionStorage.setItem(KEY_STORE, value); else sessionStorage.removeItem(KEY_STORE);
      show($('#banner'), '');
      showProfile();
      route();
    });
    $('#chat-form').addEventListener('submit', sendChat);
    $('#chat-input').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey) { ev.preventDefault(); $('#chat-form').requestSubmit(); }
    });
    $('#chat-stop').addEventListener('click', () => chat.controller && chat.controller.abort());
    $('#chat-clear').addEventListener('click', () => {
      chat.messages = []; $('#chat-log').replaceChildren(); $('#correct-panel').hidden = true; show($('#chat-error'), '');
    });
    $('#correct-submit').addEventListener('click', submitCorrection);
    $('#correct-cancel').addEventListener('click', () => { $('#correct-panel').hidden = true; chat.correcting = null; });
    trainingForm($('#sft-form'), 'sft', 'examples', ['epochs', 'learning_rate', 'lora_rank']);
    trainingForm($('#grpo-form'), 'grpo', 'groups', ['epochs', 'learning_rate', 'kl_coef']);
    trainingForm($('#opd-form'), 'opd', 'prompts', ['samples_per_prompt', 'top_k', 'steps', 'max_tokens', 'learning_rate']);
    mergeForm($('#merge-form'));
    teacherForm($('#teacher-form'));
    window.addEventListener('hashchange', route);
    window.addEventListener('resize', () => { if (currentPage === 'status') renderTpsChart(); if (currentPage === 'training') renderCharts(); });
    statusPoller.start();
    showProfile();
    route();
    document.body.dataset.ready = 'true';
  }

  init();
})();
