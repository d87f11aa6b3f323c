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
    cards.replaceChildren(...items.map(([k, v, title]) => h('div', { class: 'card', dataset: { key: k } },
      h('div', { class: 'k', text: k }), h('div', { class: 'v', text: v ?? '–', title }))));
  }

  function renderHealthPill(ok, text) {
    const pill = $('#health-pill');
    pill.textContent = text;
    pill.className = `pill ${ok ? 'ok' : 'bad'}`;
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
    const button = $('#correct-submit');
    button.disabled = true;
    delete status.dataset.jobState;
    try {
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
      status.textContent = `job ${done.id} succeeded: ${adapter} revision ${short(result.revision)}`
        + ` after ${report.steps ?? '?'} steps (final loss ${fmtNum(report.final_loss)})`
        + (report.learned === true ? '; the job reports the correction is reproduced' : '')
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

  function renderRunning(job) {
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
      h('td', { class: 'error', text: job.error || '' }));
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
    renderRunning(status.running);
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
      for (const name of ['base_adapter', 'kl_estimator']) {
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
      h('td', {}, a.active ? h('span', { class: 'badge serving', text: `serving ${short(a.active_revision)}` })
        : h('span', { class: 'badge', text: 'stored' })),
      h('td', {}, actions));
  }

  let confirmingUntil = 0;

  async function pollAdapters() {
    if (Date.now() < confirmingUntil) return 1000;
    const data = await getOrShow('/v1/adapters', $('#adapters-error'));
    const rows = (data.data || []).map(adapterRow);
    $('#adapters-table tbody').replaceChildren(...(rows.length ? rows
      : [h('tr', {}, h('td', { colspan: '8', class: 'muted', text: 'No adapters yet: train one on the Training page or from the chat playground.' }))]));
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

  // ------------------------------------------------------------------ evals / teachers

  function genericTable(items) {
    const columns = [];
    for (const item of items.slice(0, 20)) {
      for (const [k, v] of Object.entries(item || {})) {
        if (columns.length < 8 && !columns.includes(k) && (v === null || typeof v !== 'object')) columns.push(k);
      }
    }
    return h('table', { class: 'grid' },
      h('thead', {}, h('tr', {}, columns.map((c) => h('th', { text: c })))),
      h('tbody', {}, items.map((item) => h('tr', {}, columns.map((c) => h('td', { text: item && item[c] != null ? item[c] : '' }))))));
  }

  // A feature another part of the server may not have: 404 on its first path shows a placeholder;
  // otherwise each path's list is shown (extra paths are best effort).
  async function optionalFeature(box, feature, paths) {
    const [path] = paths;
    box.replaceChildren(h('p', { class: 'muted', text: `Checking GET ${path}…` }));
    const sections = [];
    for (const [i, p] of paths.entries()) {
      try {
        const { data } = await api('GET', p);
        const items = Array.isArray(data) ? data : (data && (data.data || data.runs || data.teachers)) || [];
        sections.push(h('h2', { text: `GET ${p}` }), h('p', { class: 'muted', text: `${items.length} listed` }),
          items.length ? genericTable(items) : h('p', { class: 'muted', text: 'Nothing yet.' }));
      } catch (err) {
        if (i > 0) { sections.push(h('p', { class: 'error', text: `GET ${p}: ${formatError(err)}` })); continue; }
        if (err.status === 404) {
          box.replaceChildren(h('div', { class: 'unavailable' },
            h('p', { text: `${feature} is not available on this server: GET ${p} answered 404.` }),
            h('p', { class: 'muted', text: `The server said: ${err.message}` })));
          box.dataset.available = 'false';
        } else {
          box.replaceChildren(h('p', { class: 'error', text: formatError(err) }));
          box.dataset.available = 'error';
        }
        return;
      }
    }
    box.replaceChildren(...sections.map((node) => (node.tagName === 'TABLE' ? h('div', { class: 'panel' }, node) : node)));
    box.dataset.available = 'true';
  }

  // ------------------------------------------------------------------ routing

  const PAGES = {
    status: { start: () => { statusPoller.now(); loadConfig().catch((err) => show($('#status-error'), formatError(err))); } },
    chat: { start: () => refreshModels().catch((err) => show($('#chat-error'), formatError(err))) },
    training: { start: () => trainingPoller.start(), stop: () => trainingPoller.stop() },
    adapters: { start: () => adaptersPoller.start(), stop: () => adaptersPoller.stop() },
    evals: { start: () => optionalFeature($('#evals-body'), 'Evals', ['/v1/evals/runs', '/v1/evals/suites']) },
    teachers: { start: () => optionalFeature($('#teachers-body'), 'Teachers', ['/v1/teachers']) },
  };
  let currentPage = null;

  function route() {
    const name = (location.hash.replace(/^#\/?/, '') || 'status').split('/')[0];
    const page = PAGES[name] ? name : 'status';
    if (currentPage && currentPage !== page && PAGES[currentPage].stop) PAGES[currentPage].stop();
    currentPage = page;
    for (const section of document.querySelectorAll('.page')) section.hidden = section.id !== `page-${page}`;
    for (const link of document.querySelectorAll('#nav a')) link.classList.toggle('active', link.dataset.page === page);
    document.title = `Kiln · ${page}`;
    PAGES[page].start();
    document.body.dataset.page = page;
  }

  function init() {
    const keyInput = $('#api-key');
    keyInput.value = apiKey();
    keyInput.addEventListener('change', () => {
      const value = keyInput.value.trim();
      if (value) sessionStorage.setItem(KEY_STORE, value); else sessionStorage.removeItem(KEY_STORE);
      show($('#banner'), '');
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
    mergeForm($('#merge-form'));
    window.addEventListener('hashchange', route);
    window.addEventListener('resize', () => { if (currentPage === 'status') renderTpsChart(); if (currentPage === 'training') renderCharts(); });
    statusPoller.start();
    route();
    document.body.dataset.ready = 'true';
  }

  init();
})();
