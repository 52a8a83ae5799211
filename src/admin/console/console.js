// The sluice operator console: reads and writes through /api/v1/ of the port that served it.
// Whatever came from outside (queue names, message ids, errors, bodies, headers) is put into
// the page as text (textContent), never as markup, and control characters are shown escaped.
'use strict';

const TOKEN_KEY = 'sluice-admin-token';
const POLL_MS = 2000;
const SHOWN_BYTES = 256 * 1024;

let timer = null;

// Control characters (C0 but newline and tab, DEL, C1) and bidirectional overrides, shown as
// escapes so that text cannot hide or reorder what is around it.
function visible(text) {
  if (text === null || text === undefined) return '';
  return String(text).replace(/[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069]/g,
    (c) => {
      const code = c.charCodeAt(0);
      return code < 0x100 ? '\\x' + code.toString(16).padStart(2, '0') : '\\u{' + code.toString(16) + '}';
    });
}

// An element with attributes and children; strings become text nodes.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === 'onclick') node.addEventListener('click', value);
    else if (name === 'className') node.className = value;
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(visible(child)));
  }
  return node;
}

function page(...children) {
  const main = document.getElementById('page');
  main.replaceChildren(...children.filter((c) => c !== null && c !== undefined));
}

function notice(text, ok) {
  const box = document.getElementById('notice');
  box.hidden = !text;
  box.className = ok ? 'ok' : '';
  box.textContent = visible(text || '');
}

function dash(value) {
  return value === null || value === undefined ? '–' : value;
}

function ms(value) {
  if (value === null || value === undefined) return '–';
  if (value >= 60000) return age(Math.round(value / 1000));
  return value < 1000 ? value.toFixed(value < 10 ? 1 : 0) + ' ms' : (value / 1000).toFixed(2) + ' s';
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return '–';
  const units = [[86400, 'd'], [3600, 'h'], [60, 'm'], [1, 's']];
  for (const [n, unit] of units) if (seconds >= n) return Math.floor(seconds / n) + unit;
  return '0s';
}

function when(msSinceEpoch) {
  return new Date(msSinceEpoch).toISOString().replace('T', ' ').replace('Z', '');
}

// The error of a request made without a token because none was given.
function noToken() {
  const error = new Error('no admin token given');
  error.noToken = true;
  return error;
}

// A fetch with the admin token: the one kept for this tab, else asked for (and again when the
// runner refuses it). A runner with --admin-open-reads answers reads without one: nothing is
// asked for until the first write.
async function authorized(path, options) {
  for (let tries = 0; tries < 3; tries++) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    const headers = { ...options.headers };
    if (token) headers.Authorization = 'Bearer ' + token;
    const response = await fetch(path, { ...options, headers, cache: 'no-store' });
    if (response.status !== 401) return response;
    if (token) {
      sessionStorage.removeItem(TOKEN_KEY);
      notice('The runner refused that token: ' + (await response.text()).trim());
    }
    if (!(await askToken())) throw noToken();
  }
  throw new Error('the runner refused the token');
}

async function read(path) {
  const response = await authorized(path, { headers: { Accept: 'application/json' } });
  const body = await response.json().catch(() => ({ error: 'not JSON (HTTP ' + response.status + ')' }));
  if (!response.ok) throw new Error(body.error || 'HTTP ' + response.status);
  return body;
}

// The question for the token under way, shared by the requests that need it at once.
let asking = null;

// Asks for the admin token in the page's own dialog, once for all who need it; resolves to
// it (kept for this tab), or null when cancelled.
function askToken() {
  if (!asking) asking = promptToken().finally(() => { asking = null; });
  return asking;
}

function promptToken() {
  const dialog = document.getElementById('token-dialog');
  const input = document.getElementById('token-input');
  dialog.hidden = false;
  input.value = '';
  input.focus();
  return new Promise((resolve) => {
    const done = (token) => {
      dialog.hidden = true;
      save.removeEventListener('click', onSave);
      cancel.removeEventListener('click', onCancel);
      input.removeEventListener('keydown', onKey);
      resolve(token);
    };
    const save = document.getElementById('token-save');
    const cancel = document.getElementById('token-cancel');
    const onSave = () => {
      const token = input.value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      done(token);
    };
    const onCancel = () => done(null);
    const onKey = (e) => { if (e.key === 'Enter') onSave(); };
    save.addEventListener('click', onSave);
    cancel.addEventListener('click', onCancel);
    input.addEventListener('keydown', onKey);
  });
}

// A write with the admin token (asked for first when there is none, and again when refused).
async function write(path, body) {
  if (!sessionStorage.getItem(TOKEN_KEY) && !(await askToken())) throw noToken();
  const response = await authorized(path, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(body || {}),
  });
  const text = await response.text();
  let parsed;
  try { parsed = JSON.parse(text); } catch (_) { parsed = { message: text.trim() }; }
  if (!response.ok) throw new Error(parsed.error || parsed.message || 'HTTP ' + response.status);
  return parsed;
}

async function act(what, promise) {
  try {
    const result = await promise;
    notice(what + ': ' + (result.message || 'done'), true);
    return result;
  } catch (e) {
    notice(what + ' failed: ' + e.message);
    return null;
  }
}

function pauseButton(queue) {
  return el('button', {
    type: 'button',
    'data-action': queue.paused ? 'resume' : 'pause',
    onclick: async () => {
      const verb = queue.paused ? 'resume' : 'pause';
      await act(verb + ' ' + queue.name, write('/api/v1/queues/' + encodeURIComponent(queue.name) + '/' + verb));
      route();
    },
  }, queue.paused ? 'Resume' : 'Pause');
}

const SVG = 'http://www.w3.org/2000/svg';

// Throughput (solid) and p99 latency (dashed) over the last 15 minutes, each scaled to its own
// maximum.
function chart(series) {
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('class', 'chart');
  svg.setAttribute('viewBox', '0 0 160 34');
  const line = (values, cls) => {
    const max = Math.max(1, ...values.filter((v) => v !== null));
    const points = values.map((v, i) => [i * 160 / Math.max(1, values.length - 1), 32 - 30 * (v || 0) / max]);
    const poly = document.createElementNS(SVG, 'polyline');
    poly.setAttribute('class', cls);
    poly.setAttribute('points', points.map(([x, y]) => x.toFixed(1) + ',' + y.toFixed(1)).join(' '));
    svg.append(poly);
  };
  line(series.map((p) => p.settled), 'throughput');
  line(series.map((p) => p.p99_ms), 'p99');
  const title = document.createElementNS(SVG, 'title');
  const total = series.reduce((n, p) => n + p.settled, 0);
  title.textContent = total + ' settled in 15 min (solid: per 10 s; dashed: p99)';
  svg.append(title);
  return svg;
}

function num(col, value) {
  return el('td', { className: 'num', 'data-col': col }, String(dash(value)));
}

function reloadBox(last) {
  if (!last) return el('div', { className: 'box muted', id: 'last-reload' }, 'No reload since the start.');
  if (last.result === 'applied') {
    return el('div', { className: 'box', id: 'last-reload' }, 'Last reload applied at ' + when(last.at_ms) + '.');
  }
  return el('div', { className: 'box bad', id: 'last-reload' },
    el('strong', {}, 'Last reload rejected at ' + when(last.at_ms) + '; the config before it keeps running.'),
    el('ul', {},
      last.diagnostics.map((d) => el('li', {}, d.file + ':' + d.line + ':' + d.column + ': ' + d.pointer + ': ' + d.message)),
      last.errors.map((e) => el('li', {}, e))));
}

// Names the runner this console is about, from any answer that says.
function runner(r) {
  document.getElementById('runner').textContent =
    visible('runner ' + r.host + ', pid ' + r.pid + ', sluice ' + r.version + ' — other runners have consoles of their own');
}

async function overview() {
  const data = await read('/api/v1/queues');
  runner(data.runner);
  const head = ['Queue', 'Ready', 'In flight', 'Consumers', 'Dead letters', 'Oldest', 'Paused', 'Circuit',
    'Limit', 'Handled/min', 'Duplicates/min', 'Retried/min', 'DLQ/min', 'p50', 'p99', 'Last 15 min', ''];
  const rows = data.queues.map((q) => {
    const s = q.status || {};
    const link = (hash, text) => el('a', { href: hash }, text);
    return el('tr', { 'data-queue': q.name },
      el('td', {}, link('#/queue/' + encodeURIComponent(q.name), q.name)),
      num('ready', s.ready),
      num('in_flight', q.in_flight),
      num('consumers', s.consumers),
      el('td', { className: 'num', 'data-col': 'dead_lettered' },
        link('#/dead-letters/' + encodeURIComponent(q.name), String(dash(s.dead_lettered)))),
      el('td', { 'data-col': 'oldest' }, age(s.oldest_dead_letter_age_seconds)),
      el('td', { 'data-col': 'paused', className: q.paused ? 'warn' : '' }, q.paused ? 'paused' : 'no'),
      el('td', { 'data-col': 'circuit', className: q.circuit === 'closed' ? '' : 'bad' }, q.circuit),
      num('limit', q.concurrency_limit),
      num('handled', q.handled_per_minute),
      num('duplicates', q.duplicates_per_minute),
      num('retried', q.retried_per_minute),
      num('dead_lettered_rate', q.dead_lettered_per_minute),
      el('td', { className: 'num' }, ms(q.p50_ms)),
      el('td', { className: 'num' }, ms(q.p99_ms)),
      el('td', {}, chart(q.series)),
      el('td', {}, pauseButton(q)));
  });
  page(
    data.broker_error ? el('div', { className: 'box bad' }, 'The broker cannot be read: ' + data.broker_error) : null,
    el('table', { id: 'queues' }, el('thead', {}, el('tr', {}, head.map((h) => el('th', {}, h)))), el('tbody', {}, rows)),
    el('p', { className: 'muted' }, 'Retries waiting (all queues): ' + dash(data.retries_waiting) +
      '. Rates and latencies are this runner\'s, over the last minute.'),
    reloadBox(data.last_reload));
}

function keyValues(pairs) {
  return el('table', { className: 'kv' }, pairs.map(([k, v]) =>
    el('tr', {}, el('th', {}, k),
      el('td', { className: 'wrap' }, v === null || v === undefined ? '–' : typeof v === 'string' ? v : JSON.stringify(v)))));
}

async function queuePage(name) {
  const path = '/api/v1/queues/' + encodeURIComponent(name);
  const [q, log] = await Promise.all([read(path), read(path + '/attempts')]);
  runner(q.runner);
  const h = q.handler;
  const handler = h.kind === 'webhook'
    ? [['webhook', h.method + ' ' + h.url], ['headers', h.headers.map(([n, v]) => n + ': ' + v).join('\n') || '–'],
      ['body', h.body || '(the envelope as JSON)'], ['timeout', ms(h.timeout_ms)], ['signing', h.signing ? 'on' : 'off'],
      ['on_status', h.on_status]]
    : [['command', [h.program, ...h.args].join(' ')], ['env', h.env.map(([n, v]) => n + '=' + v).join('\n') || '–'],
      ['pass_env', h.pass_env.join(', ') || '–'], ['stdin', h.stdin], ['timeout', ms(h.timeout_ms)],
      ['permanent_exit_codes', h.permanent_exit_codes.join(', ') || '–'], ['on_exit', h.on_exit]];
  const retry = q.retry;
  const rows = log.attempts.map((a) => el('tr', { 'data-outcome': a.outcome },
    el('td', {}, when(a.at_ms)),
    el('td', { className: 'wrap' }, dash(a.message_id)),
    el('td', { className: 'wrap' }, dash(a.idempotency_key)),
    el('td', { className: 'num' }, String(a.attempt)),
    el('td', { className: ['success', 'duplicate', 'filtered'].includes(a.outcome) ? 'good' : 'bad' },
      a.outcome + (a.reason ? ' (' + a.reason + ')' : '')),
    el('td', { className: 'num', 'data-col': 'status' },
      a.http_status !== null ? String(a.http_status) : a.exit_code !== null ? 'exit ' + a.exit_code : '–'),
    el('td', { className: 'num' }, ms(a.latency_ms)),
    el('td', { className: 'wrap' }, dash(a.error)),
    el('td', { className: 'wrap' }, a.excerpt ? el('details', {}, el('summary', {}, 'body'), el('pre', {}, a.excerpt)) : '–'),
    el('td', { className: 'wrap muted' }, dash(a.trace_id))));
  page(
    el('h2', {}, 'Queue ' + q.name),
    el('div', { className: 'actions' },
      el('span', { id: 'queue-state' }, (q.paused ? 'paused' : 'consuming') + ', circuit ' + q.circuit), pauseButton(q),
      el('a', { href: '#/dead-letters/' + encodeURIComponent(q.name) }, 'Dead letters (' + q.dead_letter_queue + ')')),
    keyValues([['file', q.file], ['concurrency', q.concurrency + (q.adaptive ? ' (adaptive)' : '')],
      ['rate limit', q.rate_limit || '–'], ['ordered', q.ordered ? 'yes' : 'no'],
      ['idempotency', q.idempotency ? 'on, ttl ' + ms(q.idempotency.ttl_ms) : 'off'], ...handler,
      ['retry', retry.max_attempts + ' attempts, ' + retry.backoff + ', jitter ' + retry.jitter +
        '; delays before jitter: ' + (retry.delays_ms.map(ms).join(', ') || 'none')]]),
    el('h2', {}, 'Recent attempts (the last ' + log.capacity + ', newest first)'),
    el('table', { id: 'attempts' },
      el('thead', {}, el('tr', {}, ['Time', 'Message id', 'Idempotency key', 'Attempt', 'Outcome', 'Status',
        'Latency', 'Error', 'Response / stderr', 'Trace id'].map((t) => el('th', {}, t)))),
      el('tbody', {}, rows)));
}

// The dead-letters page's filters, selection and page, kept while it is shown. A page is the
// API's (100 messages); `cursor` is where the shown one begins, `back` the cursors of the pages
// before it.
const dlq = { queue: null, reason: '', since: '', id: '', selected: new Set(), shown: null, cursor: '', back: [] };

function filterQuery() {
  const params = new URLSearchParams();
  for (const key of ['reason', 'since', 'id']) if (dlq[key]) params.set(key, dlq[key]);
  if (dlq.cursor) params.set('cursor', dlq.cursor);
  return params;
}

function filterBody() {
  const body = {};
  for (const key of ['reason', 'since', 'id']) if (dlq[key]) body[key] = dlq[key];
  return body;
}

async function showMessage(name, id) {
  const m = await read('/api/v1/queues/' + encodeURIComponent(name) + '/dead-letters/' + encodeURIComponent(id));
  let body = typeof m.body === 'string' ? m.body : JSON.stringify(m.body, null, 2);
  const cut = body.length > SHOWN_BYTES;
  if (cut) body = body.slice(0, SHOWN_BYTES);
  dlq.shown = el('div', { className: 'box', id: 'message' },
    el('h2', {}, 'Message ' + id),
    el('table', { className: 'kv', id: 'message-headers' },
      Object.entries(m.headers).map(([k, v]) => el('tr', {}, el('th', {}, k), el('td', { className: 'wrap' },
        typeof v === 'string' ? v : JSON.stringify(v))))),
    el('pre', { id: 'message-body' }, body),
    cut ? el('p', { className: 'muted' }, 'Only the first ' + SHOWN_BYTES / 1024 + ' KiB shown.') : null);
  route();
}

async function deadLettersPage(name) {
  if (dlq.queue !== name) {
    Object.assign(dlq, { queue: name, reason: '', since: '', id: '', selected: new Set(), shown: null, cursor: '', back: [] });
  }
  const base = '/api/v1/queues/' + encodeURIComponent(name) + '/dead-letters';
  const [q, data] = await Promise.all([read('/api/v1/queues/' + encodeURIComponent(name)), read(base + '?' + filterQuery())]);
  runner(q.runner);
  const ids = new Set(data.entries.map((e) => e.id));
  for (const id of [...dlq.selected]) if (!ids.has(id)) dlq.selected.delete(id);
  const input = (key, label, placeholder) => el('label', {}, label + ' ',
    el('input', { id: 'filter-' + key, value: dlq[key], placeholder }));
  const apply = () => {
    for (const key of ['reason', 'since', 'id']) dlq[key] = document.getElementById('filter-' + key).value.trim();
    Object.assign(dlq, { cursor: '', back: [] });
    route();
  };
  const turn = (cursor, back) => { Object.assign(dlq, { cursor, back }); dlq.selected.clear(); route(); };
  const pages = el('div', { className: 'actions', id: 'pages' },
    el('button', { type: 'button', id: 'first-page', disabled: !dlq.cursor, onclick: () => turn('', []) }, 'First page'),
    el('button', { type: 'button', id: 'previous-page', disabled: !dlq.cursor,
      onclick: () => turn(dlq.back[dlq.back.length - 1] || '', dlq.back.slice(0, -1)) }, 'Previous page'),
    el('button', { type: 'button', id: 'next-page', disabled: !data.next_cursor,
      onclick: () => turn(data.next_cursor, [...dlq.back, dlq.cursor]) }, 'Next page'));
  const confirmRow = document.createElement('div');
  confirmRow.className = 'actions';
  confirmRow.id = 'confirm';
  const redriveAll = async () => {
    const counted = await act('count', write(base + '/redrive', { ...filterBody(), dry_run: true }));
    if (!counted) return;
    confirmRow.replaceChildren(
      el('span', { id: 'would-go' }, counted.selected + ' message(s) would be redriven to ' + name + '.'),
      el('button', { type: 'button', id: 'confirm-redrive', onclick: async () => {
        const done = await act('redrive', write(base + '/redrive', filterBody()));
        if (done) notice(done.done + ' message(s) redriven to ' + name + '.', true);
        route();
      } }, 'Redrive them'),
      el('button', { type: 'button', onclick: () => confirmRow.replaceChildren() }, 'Cancel'));
  };
  const purgeAll = async () => {
    const counted = await act('count', write(base + '/purge', { ...filterBody(), dry_run: true }));
    if (!counted) return;
    const typed = el('input', { id: 'purge-confirm', placeholder: 'type ' + name + ' to confirm' });
    confirmRow.replaceChildren(
      el('span', {}, counted.selected + ' message(s) would be deleted for good. Type the queue name:'), typed,
      el('button', { type: 'button', className: 'danger', id: 'confirm-purge', onclick: async () => {
        if (typed.value !== name) { notice('Type the queue name exactly to purge.'); return; }
        const done = await act('purge', write(base + '/purge', { ...filterBody(), confirm: typed.value }));
        if (done) notice(done.done + ' message(s) purged from ' + data.dead_letter_queue + '.', true);
        route();
      } }, 'Purge'),
      el('button', { type: 'button', onclick: () => confirmRow.replaceChildren() }, 'Cancel'));
  };
  const redriveSelected = async () => {
    if (dlq.selected.size === 0) { notice('Select messages first.'); return; }
    const done = await act('redrive', write(base + '/redrive', { id: [...dlq.selected] }));
    if (done) notice(done.done + ' message(s) redriven to ' + name + '.', true);
    dlq.selected.clear();
    route();
  };
  const rows = data.entries.map((e) => el('tr', { 'data-id': e.id },
    el('td', {}, el('input', { type: 'checkbox', checked: dlq.selected.has(e.id), onclick: (ev) => {
      if (ev.target.checked) dlq.selected.add(e.id); else dlq.selected.delete(e.id);
    } })),
    el('td', { className: 'wrap' }, e.id ? el('a', { href: '#', onclick: (ev) => { ev.preventDefault(); showMessage(name, e.id); } }, e.id) : '–'),
    el('td', {}, dash(e.type)), el('td', {}, dash(e.reason)), el('td', { className: 'num' }, String(dash(e.attempts))),
    el('td', {}, dash(e.failed_at)), el('td', {}, age(e.age_seconds)), el('td', { className: 'wrap' }, dash(e.idempotency_key)),
    el('td', { className: 'wrap' }, dash(e.error))));
  page(
    el('h2', {}, 'Dead letters of ' + name + ' (' + data.dead_letter_queue + ')'),
    el('div', { className: 'filters actions' }, input('reason', 'Reason', 'e.g. exhausted'), input('since', 'Since', 'e.g. 1h'),
      input('id', 'Ids', 'id1,id2'), el('button', { type: 'button', id: 'filter-apply', onclick: apply }, 'Filter')),
    el('div', { className: 'actions' },
      el('button', { type: 'button', id: 'redrive-selected', onclick: redriveSelected }, 'Redrive selected'),
      el('button', { type: 'button', id: 'redrive-all', onclick: redriveAll }, 'Redrive all matching…'),
      el('button', { type: 'button', id: 'purge-all', className: 'danger', onclick: purgeAll }, 'Purge matching…'),
      pauseButton(q),
      el('a', { href: '#/queue/' + encodeURIComponent(name) }, 'Queue and attempts')),
    confirmRow,
    el('p', { className: 'muted', id: 'dlq-count' }, data.entries.length + ' message(s) shown, page ' +
      (dlq.back.length + 1) + (data.next_cursor ? '' : ' (the last)') + '; ' + data.tally.queued +
      ' in the dead-letter queue, ' + data.tally.read + ' read for this page. "Redrive all matching" and ' +
      '"Purge matching" take every page.'),
    pages,
    el('table', { id: 'dead-letters' },
      el('thead', {}, el('tr', {}, ['', 'Id', 'Type', 'Reason', 'Attempts', 'Failed at', 'Age', 'Idempotency key', 'Error']
        .map((t) => el('th', {}, t)))),
      el('tbody', {}, rows)),
    dlq.shown);
}

async function topologyPage() {
  const data = await read('/api/v1/topology');
  runner(data.runner);
  const plan = data.plan;
  const queues = Object.fromEntries(plan.queues.map((q) => [q.name, q]));
  const handler = (name) => {
    const h = data.handlers[name];
    if (!h) return null;
    return h.kind === 'webhook' ? 'webhook ' + h.method + ' ' + h.url : 'command ' + h.program;
  };
  const queueItem = (name, via) => {
    const q = queues[name] || {};
    return el('li', {}, via, el('a', { href: '#/queue/' + encodeURIComponent(name) }, name),
      ' → ', handler(name) || '(no handler)', q.dead_letter ? ' ⇢ dead letters: ' + q.dead_letter : '');
  };
  const bound = new Set(plan.bindings.map((b) => b.queue));
  const tree = el('ul', { className: 'tree', id: 'topology' },
    plan.exchanges.map((x) => el('li', {}, el('strong', {}, 'exchange ' + x.name), ' (' + x.type + ')',
      el('ul', { className: 'tree' }, plan.bindings.filter((b) => b.exchange === x.name)
        .map((b) => queueItem(b.queue, 'routing key "' + b.routing_key + '" → '))))),
    plan.queues.filter((q) => q.role === 'work' && !bound.has(q.name))
      .map((q) => queueItem(q.name, '(default exchange) → ')));
  const drift = data.drift === null
    ? el('div', { className: 'box warn' }, 'Drift unknown: ' + data.drift_error)
    : data.drift.length === 0
      ? el('div', { className: 'box good', id: 'drift' }, 'The broker matches the plan.')
      : el('div', { className: 'box bad', id: 'drift' }, el('ul', {}, data.drift.map((d) => el('li', {},
        d.kind + ': ' + Object.entries(d).filter(([k]) => k !== 'kind').map(([k, v]) => k + ' ' + v).join(', ')))));
  page(el('h2', {}, 'Topology (from the plan)'), tree, el('h2', {}, 'Drift against the broker'), drift);
}

// Renders the page the location names, and polls it.
async function route() {
  clearTimeout(timer);
  const hash = decodeURIComponent(location.hash.slice(1) || '/');
  const [, kind, name] = hash.split('/');
  try {
    if (kind === 'queue' && name) await queuePage(name);
    else if (kind === 'dead-letters' && name) await deadLettersPage(name);
    else if (kind === 'topology') await topologyPage();
    else await overview();
    document.body.dataset.loaded = hash;
  } catch (e) {
    // Without the token nothing can be read: asking again every few seconds would only nag.
    if (e.noToken) {
      notice('This runner\'s console needs its admin token: reload the page to give it.');
      return;
    }
    notice('Cannot read the runner: ' + e.message);
  }
  // The dead-letters page is read again by hand (Filter) or after an action: a poll would
  // browse the dead-letter queue every few seconds and drop what is being typed.
  if (kind !== 'dead-letters' && kind !== 'topology') timer = setTimeout(route, POLL_MS);
}

window.addEventListener('hashchange', () => { notice(''); route(); });
document.addEventListener('DOMContentLoaded', route);
