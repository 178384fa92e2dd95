// The trainyard web console: one page, views by the URL's fragment (#/jobs, #/jobs/ID, #/nodes,
// #/sharing, #/signin). It calls the coordinator's HTTP/JSON API (/api/v1) with the session
// cookie and the session's CSRF token, follows live streams (server-sent events), and builds every
// element with the DOM: text from jobs (names, logs, metric names) is only ever a text node.
'use strict';

const TERMINAL = new Set(['SUCCEEDED', 'FAILED', 'CANCELLED']);
const WAITING = new Set(['QUEUED', 'PREEMPTED', 'RESTARTING']);
const STATES = ['QUEUED', 'RUNNING', 'CHECKPOINTING', 'PREEMPTED', 'RESTARTING', 'SUCCEEDED',
  'FAILED', 'CANCELLED'];
const MAX_LOG_LINES = 5000;

const app = { me: null, csrf: '', cleanups: [] };

// An element: props are attributes (class, id, href, ...) or on* listeners; children are nodes
// or strings (as text).
function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function safeDecode(text) {
  try {
    return decodeURIComponent(text);
  } catch (e) {
    return text;  // (a malformed escape: the id as written, which the API refuses)
  }
}

function flash(message) {
  const f = document.getElementById('flash');
  f.textContent = message || '';
  f.hidden = !message;
}

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(method, path, body) {
  const options = { method, credentials: 'same-origin', headers: {} };
  if (method !== 'GET') {
    options.headers['X-CSRF-Token'] = app.csrf;
    options.headers['Content-Type'] = 'application/json';
    options.body = JSON.stringify(body || {});
  }
  const r = await fetch(path, options);
  const j = await r.json().catch(() => ({}));
  if (!r.ok) {
    const e = j.error || {};
    if (r.status === 401 && path !== '/api/v1/session') {
      app.me = null;
      location.hash = '#/signin';
    }
    throw new ApiError(r.status, e.code || String(r.status), e.message || r.statusText);
  }
  return j;
}

function num(v) { return v === undefined || v === null ? 0 : Number(v); }
function when(ms) { return num(ms) > 0 ? new Date(num(ms)).toLocaleString() : '—'; }
function fmt(v, digits) {
  if (v === undefined || v === null) return '—';
  const n = Number(v);
  if (!Number.isFinite(n)) return String(v);
  return Math.abs(n) >= 1e4 ? n.toLocaleString(undefined, { maximumFractionDigits: 0 })
    : n.toFixed(digits === undefined ? 4 : digits);
}
function bytes(v) {
  let n = num(v);
  for (const unit of ['B', 'KiB', 'MiB', 'GiB', 'TiB']) {
    if (n < 1024 || unit === 'TiB') return `${n.toFixed(unit === 'B' ? 0 : 1)} ${unit}`;
    n /= 1024;
  }
}
function stateBadge(state) {
  const s = state || 'QUEUED';
  return el('span', { class: `state state-${s}`, 'data-state': s }, s);
}
function canControl(job) {
  return app.me && (app.me.admin || app.me.user === job.owner);
}

// What the current view opened (live streams, timers): closed when the view changes.
function onLeave(f) { app.cleanups.push(f); }
function leave() {
  for (const f of app.cleanups.splice(0)) {
    try { f(); } catch (e) { /* already closed */ }
  }
}
function stream(path, handlers) {
  const source = new EventSource(path, { withCredentials: true });
  for (const [event, f] of Object.entries(handlers)) {
    source.addEventListener(event, (e) => f(JSON.parse(e.data)));
  }
  // The server ended it: the job ended (nothing more will come) or a read was refused (the
  // session's token was revoked). No reconnecting either way.
  source.addEventListener('end', () => source.close());
  source.addEventListener('refused', (e) => {
    source.close();
    const r = JSON.parse(e.data);
    if (r.code === 'UNAUTHENTICATED') {
      app.me = null;
      location.hash = '#/signin';
    } else {
      flash(r.message);
    }
  });
  // A dropped connection is retried by the browser itself; an answer that is not a stream (401,
  // 403, 503) closes it: say why, or sign in again.
  source.addEventListener('error', () => {
    if (source.readyState !== EventSource.CLOSED) return;
    api('GET', '/api/v1/session').then(
      () => flash('Live updates stopped (too many pages open?); reload to try again.'),
      () => {});  // (api() went to the sign-in page)
  });
  onLeave(() => source.close());
  return source;
}

// --- the frame ---

function renderFrame() {
  const nav = document.getElementById('nav');
  const who = document.getElementById('who');
  nav.replaceChildren();
  who.replaceChildren();
  if (!app.me) return;
  const here = location.hash.split('?')[0];
  for (const [href, label] of [['#/jobs', 'Jobs'], ['#/nodes', 'Nodes'], ['#/sharing', 'Sharing']]) {
    nav.append(el('a', { href, class: here.startsWith(href) ? 'active' : null }, label));
  }
  who.append(el('span', { id: 'me' }, app.me.user, app.me.admin ? ' (admin)' : ''),
    el('button', { id: 'signout', onclick: signOut }, 'Sign out'));
}

async function signOut() {
  try { await api('DELETE', '/api/v1/session'); } catch (e) { /* signed out anyway */ }
  app.me = null;
  app.csrf = '';
  location.hash = '#/signin';
}

// --- sign in ---

function viewSignIn(main, params) {
  const token = el('textarea', { id: 'token', name: 'token', autocomplete: 'off', spellcheck: 'false',
    placeholder: 'tyt.…' });
  const form = el('form', { class: 'signin', id: 'signin-form' },
    el('h1', {}, 'Sign in'),
    el('p', { class: 'muted' }, 'Paste an API token (yard admin token create makes one; yard web prints a link that signs you in).'),
    token, el('p', {}, el('button', { class: 'primary', type: 'submit', id: 'signin' }, 'Sign in')));
  const signIn = async (body) => {
    try {
      const me = await api('POST', '/api/v1/session', body);
      app.me = me;
      app.csrf = me.csrfToken;
      flash('');
      location.replace('#/jobs');  // (a link's code leaves the history)
    } catch (err) {
      flash(`Sign-in refused: ${err.message}`);
    }
  };
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    signIn({ token: token.value.trim() });
  });
  // A one-time link from `yard web` (#/signin?code=...) signs in as whoever made it: only when
  // asked here, never by opening a link someone sent.
  if (params.get('code')) {
    main.append(el('div', { class: 'signin', id: 'link-signin' },
      el('h1', {}, 'Sign in with a link'),
      el('p', {}, 'This link signs you in as the user who made it with ', el('code', {}, 'yard web'),
        '. Use it only if you made it yourself.'),
      el('p', {}, el('button', { class: 'primary', id: 'use-link',
        onclick: () => signIn({ code: params.get('code') }) }, 'Sign in with this link'))));
    return;
  }
  main.append(form);
}

// --- jobs ---

function jobQuery(params) {
  const q = new URLSearchParams();
  for (const k of ['state', 'owner', 'name', 'account', 'page_token']) {
    if (params.get(k)) q.append(k, params.get(k));
  }
  q.set('page_size', '50');
  return q;
}

function viewJobs(main, params) {
  const field = (name, label, input) => el('label', {}, label, input);
  const state = el('select', { name: 'state', id: 'filter-state' }, el('option', { value: '' }, 'any'),
    STATES.map((s) => el('option', { value: s, selected: params.get('state') === s }, s)));
  const inputs = {};
  for (const k of ['name', 'owner', 'account']) {
    inputs[k] = el('input', { name: k, id: `filter-${k}`, value: params.get(k) || '', size: 14 });
  }
  const form = el('form', { class: 'filters', id: 'job-filters' }, field('state', 'State', state),
    field('name', 'Name contains', inputs.name),
    app.me.admin ? field('owner', 'Owner', inputs.owner) : null,
    field('account', 'Account', inputs.account),
    el('button', { type: 'submit' }, 'Filter'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    if (state.value) q.set('state', state.value);
    for (const k of Object.keys(inputs)) if (inputs[k].value) q.set(k, inputs[k].value);
    location.hash = `#/jobs?${q}`;
  });
  const body = el('tbody', { id: 'jobs-body' });
  const more = el('p', {});
  main.append(el('h1', {}, 'Jobs'), form,
    el('table', { id: 'jobs' }, el('thead', {}, el('tr', {}, ['Job', 'Name', 'Owner', 'Account',
      'State', 'Step', 'Loss', 'Submitted'].map((h) => el('th', {}, h)))), body), more);
  const show = (page) => {
    body.replaceChildren(...(page.jobs || []).map((j) => el('tr', { 'data-job': j.id },
      el('td', {}, el('a', { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.id)),
      el('td', {}, el('div', { class: 'job-name' }, (j.spec && j.spec.name) || ''),
        j.spec && j.spec.description ? el('div', { class: 'job-desc muted' }, j.spec.description) : null),
      el('td', {}, j.owner), el('td', {}, j.account || ''), el('td', {}, stateBadge(j.state)),
      el('td', { class: 'num' }, num(j.step)), el('td', { class: 'num' }, j.loss ? fmt(j.loss) : '—'),
      el('td', {}, when(j.submitTimeMs)))));
    if (!(page.jobs || []).length) body.append(el('tr', {}, el('td', { colspan: 8, class: 'muted' }, 'No jobs.')));
    performance.mark('jobs-shown');  // (bench/web_console_bench.py reads the first)
    more.replaceChildren();
    if (page.nextPageToken) {
      const q = new URLSearchParams(params);
      q.set('page_token', page.nextPageToken);
      more.append(el('a', { href: `#/jobs?${q}`, id: 'older' }, 'Older jobs →'));
    }
  };
  const q = jobQuery(params);
  if (params.get('page_token')) {
    api('GET', `/api/v1/jobs?${q}`).then(show, (e) => flash(e.message));
  } else {
    // The first page follows the cluster: the stream sends it again after every change.
    stream(`/api/v1/jobs/events?${q}`, { jobs: show });
  }
}

// --- one job ---

class Chart {
  constructor(parent, key, title) {
    this.points = new Map();
    this.plot = el('div', { class: 'plot' });
    this.box = el('div', { class: 'chart', 'data-chart': key, 'data-points': '0' },
      el('h3', {}, title), this.plot);
    parent.append(this.box);
    this.graph = null;
  }
  add(step, value) {
    if (!Number.isFinite(value)) return;
    this.points.set(step, value);
  }
  draw() {
    const data = [...this.points.entries()].sort((a, b) => a[0] - b[0]);
    this.box.setAttribute('data-points', String(data.length));
    if (!data.length || typeof Dygraph === 'undefined') return;
    // Fixed labels: series names never reach the library's HTML (its legend uses innerHTML).
    if (!this.graph) {
      this.graph = new Dygraph(this.plot, data, { labels: ['step', 'value'], legend: 'never',
        axes: { y: { axisLabelWidth: 64 } },
        drawPoints: data.length < 50, strokeWidth: 1.5, xlabel: 'step' });
    } else {
      this.graph.updateOptions({ file: data, drawPoints: data.length < 50 });
    }
  }
}

function viewJob(main, id) {
  const title = el('h1', { id: 'job-title' }, id);
  const actions = el('div', { class: 'actions', id: 'job-actions' });
  const facts = el('dl', { class: 'facts', id: 'job-facts' });
  const timeline = el('ol', { class: 'timeline', id: 'job-timeline' });
  const checkpoints = el('tbody', { id: 'job-checkpoints' });
  const charts = el('div', { class: 'charts', id: 'job-charts' });
  const search = el('input', { id: 'log-search', placeholder: 'search the logs', size: 30 });
  const logs = el('div', { class: 'logs', id: 'job-logs' });
  const spec = el('pre', { class: 'spec', id: 'job-spec' });
  main.append(el('p', {}, el('a', { href: '#/jobs' }, '← Jobs')), title, actions, facts,
    el('h2', {}, 'Timeline'), timeline,
    el('h2', {}, 'Charts'), charts,
    el('h2', {}, 'Logs'), el('p', {}, search), logs,
    el('h2', {}, 'Checkpoints'),
    el('table', {}, el('thead', {}, el('tr', {}, ['Step', 'Attempt', 'Size', 'Eval loss', 'Written', 'Path']
      .map((h) => el('th', {}, h)))), checkpoints),
    el('h2', {}, 'Spec'), spec);

  let job = null;
  // Why it waits: GetJob says (the stream's changes do not), read again while it waits.
  let why = '';
  const showJob = (j) => {
    job = j;
    if (j.whyWaiting || !WAITING.has(j.state)) why = j.whyWaiting || '';
    facts.dataset.shown = String(num(facts.dataset.shown) + 1);
    title.replaceChildren((j.spec && j.spec.name) || j.id, ' ', stateBadge(j.state));
    const rows = [
      ['Job', j.id], ['Description', (j.spec && j.spec.description) || '—'], ['Owner', j.owner], ['Account', j.account || '—'], ['State', stateBadge(j.state)],
      ['Why it waits', why || (j.state === 'QUEUED' ? 'being placed' : '—')],
      ['Message', j.message || '—'],
      ['Attempt', `${num(j.attempt)} (restarts ${num(j.restarts)}, preemptions ${num(j.preemptions)})`],
      ['Step', `${num(j.step)}${j.spec && j.spec.train && j.spec.train.steps ? ` of ${j.spec.train.steps}` : ''}`],
      ['Loss', j.loss ? fmt(j.loss) : '—'], ['Eval loss', j.evalLoss ? fmt(j.evalLoss) : '—'],
      ['World size', num(j.worldSize)],
      ['Placement', (j.placement || []).map((p) => `${p.nodeId || ''}[${(p.deviceIndices || []).join(',')}]`).join(' ') || '—'],
    ];
    facts.replaceChildren(...rows.flatMap(([k, v]) => [el('dt', {}, k), el('dd', { 'data-fact': k }, v)]));
    // Each attempt whose ranks ended, from what they used (rankUsage): where they ran and how
    // they exited; then the current attempt's start and the end.
    const attempts = new Map();
    for (const u of j.rankUsage || []) {
      const a = num(u.attempt);
      if (!attempts.has(a)) attempts.set(a, []);
      attempts.get(a).push(u);
    }
    const ended = [...attempts.keys()].sort((x, y) => x - y).map((a) => {
      const ranks = attempts.get(a);
      const codes = [...new Set(ranks.map((u) => num(u.exitCode)))].join(', ');
      const nodes = [...new Set(ranks.map((u) => u.nodeId || '?'))].join(', ');
      return el('li', { 'data-attempt': a }, el('b', {}, `Attempt ${a}`),
        `${ranks.length} rank${ranks.length === 1 ? '' : 's'} on ${nodes} exited ${codes}`);
    });
    timeline.replaceChildren(
      el('li', {}, el('b', {}, 'Submitted'), when(j.submitTimeMs)),
      ...ended,
      num(j.startTimeMs) > 0 ? el('li', {}, el('b', {}, `Attempt ${num(j.attempt)} started`),
        when(j.startTimeMs)) : null,
      el('li', {}, el('b', {}, TERMINAL.has(j.state) ? j.state.toLowerCase() : 'Now'),
        TERMINAL.has(j.state) ? when(j.endTimeMs) : stateBadge(j.state)));
    checkpoints.replaceChildren(...(j.keptCheckpoints || []).map((c) => el('tr', {},
      el('td', { class: 'num' }, num(c.step)), el('td', { class: 'num' }, num(c.attempt)),
      el('td', { class: 'num' }, bytes(c.bytes)),
      el('td', { class: 'num' }, c.evalLoss !== undefined ? fmt(c.evalLoss) : '—'),
      el('td', {}, when(c.timeMs)), el('td', {}, c.path || ''))));
    if (!(j.keptCheckpoints || []).length) {
      checkpoints.append(el('tr', {}, el('td', { colspan: 6, class: 'muted' }, 'None yet.')));
    }
    spec.textContent = JSON.stringify(j.spec || {}, null, 2);
    actions.replaceChildren();
    if (canControl(j) && !TERMINAL.has(j.state)) {
      actions.append(
        el('button', { id: 'checkpoint', onclick: () => act('checkpoint') }, 'Checkpoint now'),
        el('button', { id: 'cancel', class: 'danger', onclick: () => act('cancel') }, 'Cancel job'));
    }
  };
  const act = async (verb) => {
    if (verb === 'cancel' && !window.confirm(`Cancel ${id}?`)) return;
    try {
      showJob(await api('POST', `/api/v1/jobs/${encodeURIComponent(id)}/${verb}`, {}));
      flash('');
    } catch (e) {
      flash(`${verb}: ${e.message}`);
    }
  };

  // Charts: built-in series first, then the program's own metrics, each made on its first point.
  const series = new Map();
  const chart = (key, label) => {
    if (!series.has(key)) series.set(key, new Chart(charts, key, label));
    return series.get(key);
  };
  let dirty = false;
  const addStep = (s) => {
    if (num(s.rank) !== 0) return;
    const step = num(s.step);
    chart('loss', 'loss').add(step, num(s.loss));
    if (s.evalLoss !== undefined) chart('eval_loss', 'eval loss').add(step, num(s.evalLoss));
    if (s.lr !== undefined) chart('lr', 'learning rate').add(step, num(s.lr));
    if (s.tokensPerSecond !== undefined) chart('tokens_per_second', 'tokens/s').add(step, num(s.tokensPerSecond));
    for (const [name, value] of Object.entries(s.metrics || {})) {
      chart(`metric:${name}`, name).add(step, num(value));
    }
    dirty = true;
  };
  const timer = setInterval(() => {
    if (!dirty) return;
    dirty = false;
    for (const c of series.values()) c.draw();
  }, 250);
  onLeave(() => clearInterval(timer));

  const matches = (line) => !search.value || line.textContent.toLowerCase().includes(search.value.toLowerCase());
  search.addEventListener('input', () => {
    for (const line of logs.children) line.classList.toggle('hidden', !matches(line));
  });
  const seen = new Set();  // attempt:rank:seq of the lines shown (a reconnect sends some again)
  const addLog = (l) => {
    if (num(l.seq) > 0) {
      const key = `${num(l.attempt)}:${num(l.rank)}:${l.seq}`;
      if (seen.has(key)) return;
      seen.add(key);
    }
    const follow = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    const line = el('div', { class: 'line' }, el('span', { class: 'meta' }, `[${num(l.attempt)}:${num(l.rank)}] `), l.text || '');
    if (!matches(line)) line.classList.add('hidden');
    logs.append(line);
    while (logs.children.length > MAX_LOG_LINES) logs.firstChild.remove();
    if (follow) logs.scrollTop = logs.scrollHeight;
  };

  api('GET', `/api/v1/jobs/${encodeURIComponent(id)}`).then((j) => {
    showJob(j);
    stream(`/api/v1/jobs/${encodeURIComponent(id)}/events`, {
      job: showJob, log: addLog, step: addStep,
    });
    const again = setInterval(() => {
      if (job && WAITING.has(job.state)) {
        api('GET', `/api/v1/jobs/${encodeURIComponent(id)}`).then((k) => {
          if (k.whyWaiting && job && WAITING.has(job.state)) showJob(Object.assign({}, job, { whyWaiting: k.whyWaiting }));
        }, () => {});
      }
    }, 5000);
    onLeave(() => clearInterval(again));
  }, (e) => {
    title.replaceChildren(id);
    flash(`${id}: ${e.message}`);
  });
}

// --- nodes ---

function viewNodes(main) {
  const body = el('tbody', { id: 'nodes-body' });
  main.append(el('h1', {}, 'Nodes'), el('table', { id: 'nodes' }, el('thead', {}, el('tr', {},
    ['Node', 'Host', 'Role', 'State', 'Devices', 'In use', 'Utilisation', 'Health', 'Cordon', '']
      .map((h) => el('th', {}, h)))), body));
  const cordon = async (node, action) => {
    try {
      await api('POST', `/api/v1/nodes/${encodeURIComponent(node.id)}/cordon`,
        { action, reason: 'from the web console' });
      flash('');
      load();
    } catch (e) {
      flash(`${action.toLowerCase()} ${node.id}: ${e.message}`);
    }
  };
  const load = () => api('GET', '/api/v1/nodes').then((r) => {
    body.replaceChildren(...(r.nodes || []).map((n) => {
      const devices = n.devices || [];
      const samples = devices.map((d) => d.sample).filter(Boolean);
      const util = samples.length ? `${Math.round(100 * samples.reduce((a, s) => a + num(s.utilization), 0) / samples.length)}%` : '—';
      const health = samples.some((s) => num(s.eccUncorrectedErrors) > 0 || num(s.lastXid) > 0) ? 'errors' : 'ok';
      const cordonText = n.draining ? 'draining' : n.cordoned ? 'cordoned' : '—';
      const buttons = app.me.admin ? [
        n.cordoned ? el('button', { 'data-action': 'uncordon', onclick: () => cordon(n, 'UNCORDON') }, 'Uncordon')
          : el('button', { 'data-action': 'cordon', onclick: () => cordon(n, 'CORDON') }, 'Cordon'),
        n.draining ? null : el('button', { 'data-action': 'drain', class: 'danger', onclick: () => cordon(n, 'DRAIN') }, 'Drain'),
      ] : [];
      return el('tr', { 'data-node': n.id },
        el('td', {}, n.id), el('td', {}, n.hostname || ''), el('td', {}, (n.role || 'WORKER').replace('NODE_ROLE_UNSPECIFIED', 'WORKER').toLowerCase()),
        el('td', {}, n.connected ? (n.state || '').replace('NODE_', '').toLowerCase() : 'disconnected'),
        el('td', {}, devices.length ? `${devices.length} × ${devices[0].name || (devices[0].kind || 'device').toLowerCase()}` : '—'),
        el('td', { class: 'num' }, (n.allocatedDevices || []).length),
        el('td', { class: 'num' }, util), el('td', {}, health),
        el('td', { class: 'cordon', title: n.cordonReason || '' }, cordonText, n.cordonedBy ? ` by ${n.cordonedBy}` : ''),
        el('td', {}, buttons));
    }));
  }, (e) => flash(e.message));
  load();
  const timer = setInterval(load, 5000);
  onLeave(() => clearInterval(timer));
}

// --- sharing ---

function viewSharing(main) {
  const accounts = el('tbody', { id: 'accounts-body' });
  const waiting = el('tbody', { id: 'waiting-body' });
  const mine = el('dl', { class: 'facts', id: 'my-quota' });
  main.append(el('h1', {}, 'Sharing'), el('h2', {}, 'You'), mine,
    el('h2', {}, 'Accounts'),
    el('table', {}, el('thead', {}, el('tr', {}, ['Account', 'Share', 'Fair share', 'Quota', 'Borrow limit',
      'Running devices', 'Queued devices', 'Queued jobs', 'Decayed use (device-h)', 'Use share']
      .map((h) => el('th', {}, h)))), accounts),
    el('h2', {}, 'Who waits on whom'),
    el('table', {}, el('thead', {}, el('tr', {}, ['Job', 'Owner', 'Account', 'Why it waits']
      .map((h) => el('th', {}, h)))), waiting));
  const load = () => {
    api('GET', `/api/v1/quota${app.me.admin ? '?all_accounts=true' : ''}`).then((q) => {
      mine.replaceChildren(...[['User', q.user], ['Account', q.account],
        ['Running devices', num(q.runningDevices)], ['Queued jobs', num(q.queuedJobs)],
        ['Max running devices', q.maxRunningDevices !== undefined ? num(q.maxRunningDevices) : 'no limit'],
        ['Decayed use (device-h)', fmt(q.usageDeviceHours, 2)],
        ['Usage half-life (h)', fmt(q.halfLifeHours, 1)]]
        .flatMap(([k, v]) => [el('dt', {}, k), el('dd', {}, v)]));
      accounts.replaceChildren(...(q.accounts || []).map((a) => el('tr', { 'data-account': a.name },
        el('td', {}, a.name), el('td', { class: 'num' }, fmt(a.share || 1, 2)),
        el('td', { class: 'num' }, `${Math.round(100 * num(a.shareFraction))}%`),
        el('td', { class: 'num' }, a.quotaDevices !== undefined ? num(a.quotaDevices) : '—'),
        el('td', { class: 'num' }, a.borrowLimitDevices !== undefined ? num(a.borrowLimitDevices) : '—'),
        el('td', { class: 'num' }, num(a.runningDevices)), el('td', { class: 'num' }, num(a.queuedDevices)),
        el('td', { class: 'num' }, num(a.queuedJobs)), el('td', { class: 'num' }, fmt(a.usageDeviceHours, 2)),
        el('td', { class: 'num' }, `${Math.round(100 * num(a.usageFraction))}%`))));
    }, (e) => flash(e.message));
    api('GET', '/api/v1/jobs?state=QUEUED&state=PREEMPTED&state=RESTARTING&page_size=200&why_waiting=true').then((r) => {
      waiting.replaceChildren(...(r.jobs || []).map((j) => el('tr', {},
        el('td', {}, el('a', { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.id)),
        el('td', {}, j.owner), el('td', {}, j.account || ''), el('td', {}, j.whyWaiting || 'being placed'))));
      if (!(r.jobs || []).length) waiting.append(el('tr', {}, el('td', { colspan: 4, class: 'muted' }, 'Nothing waits.')));
    }, (e) => flash(e.message));
  };
  load();
  const timer = setInterval(load, 5000);
  onLeave(() => clearInterval(timer));
}

// --- routing ---

let routing = 0;  // the latest route(): an earlier one still waiting renders nothing

async function route() {
  const mine = ++routing;
  leave();
  flash('');
  const [path, query] = (location.hash.replace(/^#/, '') || '/jobs').split('?');
  const params = new URLSearchParams(query || '');
  if (!app.me && path !== '/signin') {
    try {
      const me = await api('GET', '/api/v1/session');
      app.me = me;
      app.csrf = me.csrfToken;
    } catch (e) {
      if (mine === routing) location.hash = '#/signin';
      return;
    }
    if (mine !== routing) return;
  }
  renderFrame();
  const main = document.getElementById('main');
  main.replaceChildren();
  const job = path.match(/^\/jobs\/(.+)$/);
  if (path === '/signin') viewSignIn(main, params);
  else if (job) viewJob(main, safeDecode(job[1]));
  else if (path === '/nodes') viewNodes(main);
  else if (path === '/sharing') viewSharing(main);
  else viewJobs(main, params);
}

window.addEventListener('hashchange', route);
route();
