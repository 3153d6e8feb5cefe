// Switchyard operator console. Plain ES module, no dependencies, served under a strict CSP:
// every DOM node is built with createElement / createElementNS and textContent, never from
// HTML strings; every string from the API is treated as untrusted text.

const TOKEN_KEY = 'switchyard.console.token';
const SVGNS = 'http://www.w3.org/2000/svg';
// Distinguishable series colours, each at least 3:1 against white (legend order = stack order).
const PALETTE = ['#1f5fa8', '#b35c00', '#2e7d32', '#7b3fa0', '#b3261e', '#00796b', '#6d6200', '#4d4d4d'];

let token = null; // the admin credential, also in sessionStorage; never shown or logged
let view = null; // the page on screen: { ctl: AbortController, cleanups: [] }

// ---------------------------------------------------------------------------------------
// DOM helpers

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c == null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === 'class') el.setAttribute('class', v);
    else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  return el;
}

const h = (tag, attrs, ...children) => append(setAttrs(document.createElement(tag), attrs), children);
const s = (tag, attrs, ...children) => append(setAttrs(document.createElementNS(SVGNS, tag), attrs), children);
const fill = (el, ...children) => append((el.replaceChildren(), el), children);
const $ = (sel, root = document) => root.querySelector(sel);
const hidden = (text) => h('span', { class: 'visually-hidden' }, text);
let uid = 0;
const nextId = (prefix) => `${prefix}-${++uid}`;

function field(id, label, input, hint) {
  input.id = id;
  if (hint) input.setAttribute('aria-describedby', id + '-hint');
  return h('div', { class: 'field' }, h('label', { for: id }, label), input,
    hint && h('p', { class: 'hint', id: id + '-hint' }, hint));
}

const msgEl = (id) => h('p', { class: 'msg', id, 'aria-live': 'polite' });

function say(el, text, kind = 'ok') {
  if (el.textContent === text && el.classList.contains(kind)) return; // do not re-announce
  el.className = 'msg ' + kind;
  el.textContent = text;
}

const status = (text) => say($('#status'), text);

// Shows an API error in text next to what caused it; marks the field `param` names.
function sayError(el, err, form) {
  if (!err || err.name === 'AbortError' || err.status === 401) return;
  say(el, 'Error: ' + (err.message || String(err)), 'error');
  if (form && err.param) {
    const input = form.elements[String(err.param).split(/[[.]/)[0]];
    input?.setAttribute?.('aria-invalid', 'true');
    input?.closest?.('details')?.setAttribute('open', '');
    input?.focus?.();
  }
}

function clearInvalid(form) {
  for (const el of form.querySelectorAll('[aria-invalid]')) el.removeAttribute('aria-invalid');
}

// Runs a form's action with its submit button disabled; errors go to `msg`.
async function submitting(form, msg, fn) {
  const btn = form.querySelector('button[type=submit]');
  clearInvalid(form);
  say(msg, '');
  if (btn) btn.disabled = true;
  form.setAttribute('aria-busy', 'true');
  try {
    await fn();
  } catch (err) {
    sayError(msg, err, form);
  } finally {
    if (btn) btn.disabled = false;
    form.removeAttribute('aria-busy');
  }
}

// A refusal found before calling the API; `param` names the form field, as the API does.
class InputError extends Error {
  constructor(message, param) { super(message); this.param = param; }
}

// A table: columns [{label, num}], rows of cells (string | Node); the first cell of each
// row is a row header.
function table({ id, caption, columns, rows, empty = 'Nothing to show.', foot, rowAttrs }) {
  const thead = h('thead', null, h('tr', null, columns.map((c) =>
    h('th', { scope: 'col', class: c.num ? 'num' : null }, c.label))));
  const tbody = h('tbody');
  if (!rows.length) tbody.append(h('tr', null, h('td', { colspan: columns.length, class: 'empty' }, empty)));
  rows.forEach((cells, i) => {
    const tr = setAttrs(h('tr'), rowAttrs ? rowAttrs(i) : null);
    cells.forEach((c, j) => {
      const cls = columns[j]?.num ? 'num' : null;
      tr.append(j === 0 ? h('th', { scope: 'row', class: cls }, c) : h('td', { class: cls }, c));
    });
    tbody.append(tr);
  });
  const t = h('table', { id }, caption && h('caption', null, caption), thead, tbody);
  if (foot && rows.length) {
    t.append(h('tfoot', null, h('tr', null, foot.map((c, j) => j === 0
      ? h('th', { scope: 'row' }, c) : h('td', { class: columns[j]?.num ? 'num' : null }, c)))));
  }
  return h('div', { class: 'table-wrap' }, t);
}

// ---------------------------------------------------------------------------------------
// Formatting

const nf = new Intl.NumberFormat();
const nfDec = new Intl.NumberFormat(undefined, { maximumFractionDigits: 2 });
const nfCompact = new Intl.NumberFormat(undefined, { notation: 'compact', maximumFractionDigits: 1 });
// Axis ticks: compact for large values, a few significant digits for small ones (costs of a
// few microcredits would otherwise all read 0).
const nfSig = new Intl.NumberFormat(undefined, { maximumSignificantDigits: 3 });
const tick = (v) => (Math.abs(v) >= 1000 ? nfCompact.format(v) : nfSig.format(v));
const nfCredits = new Intl.NumberFormat(undefined, { minimumFractionDigits: 2, maximumFractionDigits: 6 });
const nfPct = new Intl.NumberFormat(undefined, { style: 'percent', maximumFractionDigits: 0 });
const nfUsd = new Intl.NumberFormat(undefined, { style: 'currency', currency: 'USD' });
const nfUsdFine = new Intl.NumberFormat(undefined, { style: 'currency', currency: 'USD', maximumFractionDigits: 4 });
const nfRatio = new Intl.NumberFormat(undefined, { minimumFractionDigits: 2, maximumFractionDigits: 4 });
const dtf = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });
const hhmm = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit', hourCycle: 'h23' });
const clock = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit', second: '2-digit', hourCycle: 'h23' });

const num = (v) => (v == null ? '—' : nf.format(v));
const usd = (v) => (v == null ? '—' : nfUsd.format(v));
const credits = (micro) => (micro == null ? '—' : `${nfCredits.format(micro / 1e6)} credits`);
const pair = (o, a, b) => (o ? `${num(o[a])} / ${num(o[b])}` : '—');
const tokensPair = (o) => pair(o, 'prompt_tokens', 'completion_tokens');

const utcTitle = (d) => 'UTC ' + d.toISOString().replace('.000Z', 'Z');

// A <time> in the browser's local time, the UTC instant in its title.
function timeEl(iso, text) {
  if (!iso) return '—';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return h('time', { datetime: d.toISOString(), title: utcTitle(d) }, text ?? dtf.format(d));
}

function ago(iso) {
  if (!iso) return 'never';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  const sec = Math.max(0, Math.round((Date.now() - d.getTime()) / 1000));
  const text = sec < 60 ? `${sec} s ago` : sec < 3600 ? `${Math.floor(sec / 60)} min ago`
    : sec < 86400 ? `${Math.floor(sec / 3600)} h ago` : dtf.format(d);
  return timeEl(iso, text);
}

// UTC days as YYYY-MM-DD.
const todayUtc = () => new Date().toISOString().slice(0, 10);
function addDays(day, n) {
  const d = new Date(day + 'T00:00:00Z');
  d.setUTCDate(d.getUTCDate() + n);
  return d.toISOString().slice(0, 10);
}
function dayRange(from, to) {
  const out = [];
  for (let d = from; d <= to && out.length < 1000; d = addDays(d, 1)) out.push(d);
  return out;
}

// Two <input type=date> fields (inclusive UTC days) -> the half-open RFC 3339 range [from, to).
function dateFields(prefix, days = 7) {
  const to = todayUtc();
  const fromIn = h('input', { type: 'date', name: 'from', required: true, value: addDays(to, 1 - days) });
  const toIn = h('input', { type: 'date', name: 'to', required: true, value: to });
  const read = () => {
    const from = fromIn.value, toDay = toIn.value;
    if (!/^\d{4}-\d{2}-\d{2}$/.test(from)) throw new InputError('Enter a start date.', 'from');
    if (!/^\d{4}-\d{2}-\d{2}$/.test(toDay)) throw new InputError('Enter an end date.', 'to');
    if (toDay < from) throw new InputError('The end date is before the start date.', 'to');
    return { fromDay: from, toDay, from: from + 'T00:00:00Z', to: addDays(toDay, 1) + 'T00:00:00Z' };
  };
  return {
    fields: [field(prefix + '-from', 'From (UTC day)', fromIn),
      field(prefix + '-to', 'To (UTC day, included)', toIn)],
    read,
  };
}

// ---------------------------------------------------------------------------------------
// API

class ApiError extends Error {
  constructor(status, message, code, param) {
    super(message);
    Object.assign(this, { name: 'ApiError', status, code: code ?? null, param: param ?? null });
  }
}

// One call to the admin API with the credential. Answers the parsed JSON (or the Response,
// with opts.raw); throws ApiError with the envelope's message. A 401 signs out, except
// while signing in.
async function api(method, path, body, opts = {}) {
  const headers = { Accept: opts.accept || 'application/json', Authorization: 'Bearer ' + (opts.token ?? token) };
  const init = { method, headers, cache: 'no-store', credentials: 'same-origin', redirect: 'error' };
  const signal = 'signal' in opts ? opts.signal : view?.ctl.signal;
  if (signal) init.signal = signal;
  if (body != null) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, init);
  } catch (err) {
    if (err.name === 'AbortError') throw err;
    throw new ApiError(0, 'Could not reach the server. Check the connection and try again.');
  }
  if (res.status === 401 && !opts.signIn) {
    signOut('Your session has ended or the credential is no longer accepted. Sign in again.');
    throw new ApiError(401, 'Unauthorized.');
  }
  if (opts.raw && res.ok) return res;
  const text = await res.text();
  let data;
  try { data = text ? JSON.parse(text) : null; } catch { /* not JSON: data stays undefined */ }
  if (!res.ok) {
    const e = data?.error;
    const message = typeof e?.message === 'string' && e.message ? e.message : `The server answered HTTP ${res.status}.`;
    throw new ApiError(res.status, message, e?.code, e?.param);
  }
  if (data === undefined) throw new ApiError(res.status, 'The server sent an answer that is not JSON.');
  return data;
}

const teamsList = async () => (await api('GET', '/admin/teams')).data || [];

function teamOptions(select, teams, selected, first) {
  select.replaceChildren(h('option', { value: '' }, first));
  for (const t of teams) {
    select.append(h('option', { value: t.id, selected: String(t.id) === String(selected) },
      `${t.name} (id ${t.id})`));
  }
}

// ---------------------------------------------------------------------------------------
// Sign-in, sign-out, routing

function showSignIn(message) {
  toggleSignedIn(false);
  document.title = 'Sign in · Switchyard console';
  say($('#signin-error'), message || '', 'error');
  $('#signin-token').focus();
}

function signOut(message) {
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  leaveView();
  $('#view').replaceChildren();
  say($('#status'), '');
  showSignIn(message);
}

async function signIn(ev) {
  ev.preventDefault();
  const input = $('#signin-token');
  const err = $('#signin-error');
  const btn = $('#signin-submit');
  const candidate = input.value.trim();
  input.removeAttribute('aria-invalid');
  if (!candidate) {
    input.setAttribute('aria-invalid', 'true');
    return say(err, 'Error: enter the admin token.', 'error');
  }
  btn.disabled = true;
  say(err, 'Checking…', 'ok');
  try {
    // Header values must be printable ASCII; anything else cannot be a credential.
    if (!/^[\x21-\x7e]+$/.test(candidate)) throw new ApiError(401, '');
    await api('GET', '/admin/teams', null, { token: candidate, signIn: true, signal: null });
    token = candidate;
    sessionStorage.setItem(TOKEN_KEY, candidate);
    input.value = '';
    say(err, '');
    enterApp(true);
  } catch (e) {
    input.setAttribute('aria-invalid', 'true');
    const text = e.status === 401 ? 'That token was not accepted.'
      : e.status === 403 ? 'That credential has no admin rights.' : e.message;
    say(err, 'Error: ' + text, 'error');
    input.focus();
  } finally {
    btn.disabled = false;
  }
}

function toggleSignedIn(on) {
  $('#signin').hidden = on;
  for (const sel of ['#app', '#nav', '#signout']) $(sel).hidden = !on;
}

function enterApp(focus) {
  toggleSignedIn(true);
  route(focus);
}

function leaveView() {
  if (!view) return;
  view.ctl.abort();
  for (const fn of view.cleanups) try { fn(); } catch { /* a cleanup must not stop the others */ }
  view = null;
}

const PAGES = {
  teams: ['Teams', pageTeams],
  keys: ['Keys', pageKeys],
  usage: ['Usage', pageUsage],
  nodes: ['Nodes', pageNodes],
  queues: ['Queues', pageQueues],
  reports: ['Reports', pageReports],
};

function route(focus) {
  if (!token) return;
  const m = /^#\/([a-z]+)(?:\?(.*))?$/.exec(location.hash);
  let name = m && m[1];
  const params = new URLSearchParams((m && m[2]) || '');
  if (!Object.hasOwn(PAGES, name)) {
    name = 'teams';
    history.replaceState(null, '', '#/teams');
  }
  leaveView();
  const v = { ctl: new AbortController(), cleanups: [] };
  view = v;
  const [title, page] = PAGES[name];
  document.title = `${title} · Switchyard console`;
  for (const a of document.querySelectorAll('#nav a')) {
    if (a.getAttribute('href') === '#/' + name) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  say($('#status'), '');
  const heading = h('h2', { id: 'page-title', tabindex: '-1' }, title);
  const root = $('#view');
  root.replaceChildren(heading);
  const ctx = { signal: v.ctl.signal, params, root, onLeave: (fn) => v.cleanups.push(fn) };
  page(ctx).catch((err) => {
    if (err?.name === 'AbortError' || err?.status === 401) return;
    const msg = msgEl();
    root.append(msg);
    sayError(msg, err);
  });
  if (focus) heading.focus();
}

// Runs fn now and every `ms` while the page is shown and the document visible.
function poll(ctx, fn, ms) {
  let timer = null, running = false;
  const stop = () => { clearTimeout(timer); timer = null; };
  const tick = async () => {
    timer = null;
    if (ctx.signal.aborted || document.hidden) return;
    running = true;
    try { await fn(); } catch { /* fn shows its own errors */ } finally { running = false; }
    if (!ctx.signal.aborted && !document.hidden) timer = setTimeout(tick, ms);
  };
  const onVisibility = () => (document.hidden ? stop() : !timer && !running && tick());
  document.addEventListener('visibilitychange', onVisibility);
  ctx.onLeave(() => { stop(); document.removeEventListener('visibilitychange', onVisibility); });
  tick();
  return () => { if (!running) { stop(); tick(); } };
}

// ---------------------------------------------------------------------------------------
// Teams

async function pageTeams(ctx) {
  const { root, signal } = ctx;
  const nameIn = h('input', { type: 'text', name: 'name', required: true, maxlength: 128, autocomplete: 'off' });
  const createMsg = msgEl('create-team-msg');
  const form = h('form', { id: 'create-team-form', class: 'panel inline-form', novalidate: true },
    h('h3', null, 'Create team'),
    field('team-name', 'Team name', nameIn, 'Up to 128 characters; not a number.'),
    h('button', { type: 'submit', id: 'create-team-submit' }, 'Create team'),
    createMsg);
  const listMsg = msgEl('teams-msg');
  const tableBox = h('div');
  const panel = h('section', { id: 'team-panel', class: 'panel', 'aria-labelledby': 'team-panel-title', hidden: true });
  root.append(form, h('h3', null, 'All teams'), listMsg, tableBox, panel);

  let teams = [];
  let selected = ctx.params.get('team');

  function render() {
    tableBox.replaceChildren(table({
      id: 'teams-table',
      caption: 'Teams and their balances',
      columns: [{ label: 'Name' }, { label: 'ID', num: true }, { label: 'Balance', num: true }, { label: 'Actions' }],
      empty: 'No teams yet. Create one above.',
      rowAttrs: (i) => ({ 'data-team': teams[i].id, class: String(teams[i].id) === String(selected) ? 'selected' : null }),
      rows: teams.map((t) => [
        t.name,
        String(t.id),
        credits(t.balance_microcredits),
        h('span', { class: 'actions' },
          h('button', { type: 'button', class: 'secondary team-credits', 'data-team': t.id, onclick: () => openTeam(t) },
            'Credits', hidden(` for ${t.name}`)),
          h('a', { href: `#/keys?team=${encodeURIComponent(t.id)}`, class: 'team-keys' }, 'Keys', hidden(` of ${t.name}`))),
      ]),
    }));
  }

  async function load() {
    teams = await teamsList();
    if (signal.aborted) return;
    render();
  }

  function openTeam(t, focus = true) {
    selected = t.id;
    render();
    const amountIn = h('input', { type: 'number', name: 'amount', step: 'any', required: true, inputmode: 'decimal' });
    const msg = msgEl('credits-msg');
    const balance = h('p', { id: 'team-balance' }, 'Balance: ', h('strong', null, credits(t.balance_microcredits)));
    const history = h('div', { id: 'credits-history-box' });
    const title = h('h3', { id: 'team-panel-title', tabindex: '-1' }, `Credits: ${t.name}`);
    const creditForm = h('form', { id: 'credits-form', class: 'inline-form', novalidate: true },
      field('credits-amount', 'Amount (credits)', amountIn, 'A decimal number of credits; negative for a correction.'),
      h('button', { type: 'submit', id: 'credits-submit' }, 'Add credits'),
      msg);
    creditForm.addEventListener('submit', (ev) => {
      ev.preventDefault();
      submitting(creditForm, msg, async () => {
        if (amountIn.validity.badInput) throw new InputError('Enter the amount as a number of credits, such as 12.5.', 'amount');
        const x = Number(amountIn.value);
        if (amountIn.value.trim() === '' || !Number.isFinite(x)) throw new InputError('Enter an amount in credits.', 'amount');
        const amount = Math.round(x * 1e6);
        if (amount === 0) throw new InputError('The amount must not be zero.', 'amount');
        const r = await api('POST', '/admin/credits', { team: t.id, amount });
        t.balance_microcredits = r.balance_microcredits;
        balance.replaceChildren('Balance: ', h('strong', null, credits(r.balance_microcredits)));
        amountIn.value = '';
        say(msg, `${amount < 0 ? 'Removed' : 'Added'} ${credits(Math.abs(amount))}. New balance: ${credits(r.balance_microcredits)}.`);
        render();
        loadHistory(t, history);
      });
    });
    panel.replaceChildren(
      h('div', { class: 'panel-head' }, title,
        h('button', { type: 'button', class: 'secondary', id: 'team-panel-close', onclick: closeTeam }, 'Close')),
      balance, creditForm,
      h('h4', null, 'Credits history'), history);
    panel.hidden = false;
    loadHistory(t, history);
    if (focus) title.focus();
  }

  function closeTeam() {
    const id = selected;
    selected = null;
    panel.hidden = true;
    panel.replaceChildren();
    render();
    $(`button.team-credits[data-team="${CSS.escape(String(id))}"]`, tableBox)?.focus();
  }

  async function loadHistory(t, box) {
    const msg = msgEl();
    box.replaceChildren(h('p', { class: 'muted' }, 'Loading…'));
    try {
      const r = await api('GET', `/admin/credits?team=${encodeURIComponent(t.id)}`);
      const entries = r.data || [];
      box.replaceChildren(table({
        id: 'credits-history',
        caption: `Credit entries of ${t.name}, newest first`,
        columns: [{ label: 'Date' }, { label: 'Amount', num: true }, { label: 'Note' }],
        empty: 'No credit entries.',
        rows: entries.map((e) => [timeEl(e.created_at), credits(e.amount_microcredits), e.note ?? '']),
      }));
    } catch (err) {
      box.replaceChildren(msg);
      sayError(msg, err);
    }
  }

  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    submitting(form, createMsg, async () => {
      const name = nameIn.value.trim();
      if (!name) throw new InputError('Enter a team name.', 'name');
      const t = await api('POST', '/admin/teams', { name });
      nameIn.value = '';
      say(createMsg, `Team “${t.name}” created (id ${t.id}).`);
      await load();
    });
  });

  try {
    await load();
    const t = selected != null && teams.find((x) => String(x.id) === String(selected));
    if (t) openTeam(t, false);
    else selected = null;
  } catch (err) {
    sayError(listMsg, err);
  }
}

// ---------------------------------------------------------------------------------------
// Keys

function keyStatus(k, now = Date.now()) {
  if (k.revoked_at) return 'revoked';
  if (k.expires_at && new Date(k.expires_at).getTime() <= now) return 'expired';
  return 'active';
}

async function pageKeys(ctx) {
  const { root, signal } = ctx;
  const select = h('select', { name: 'team' });
  const teamMsg = msgEl('keys-team-msg');
  const newKeyBox = h('div', { id: 'new-key-box' });
  const listMsg = msgEl('keys-msg');
  const tableBox = h('div');
  const createMsg = msgEl('create-key-msg');
  const intIn = (name, max) => h('input', { type: 'number', name, min: 0, max, step: 1, inputmode: 'numeric' });
  const inputs = {
    model_allowlist: h('input', { type: 'text', name: 'model_allowlist', autocomplete: 'off', spellcheck: 'false' }),
    rpm: intIn('rpm', 1000000),
    tokens_per_day: intIn('tokens_per_day', 1e12),
    max_streams: intIn('max_streams', 100000),
    expires_at: h('input', { type: 'datetime-local', name: 'expires_at' }),
    message_quota: intIn('message_quota', 1000000),
    burst_capacity: intIn('burst_capacity', 1000000),
    burst_refill_seconds: intIn('burst_refill_seconds', 86400),
  };
  inputs.burst_capacity.min = 1;
  inputs.burst_refill_seconds.min = 1;
  const form = h('form', { id: 'create-key-form', class: 'panel', novalidate: true },
    h('h3', { id: 'create-key-title', tabindex: '-1' }, 'Create key'),
    h('p', { class: 'hint' }, 'Every field is optional: an empty field means the configured default (or no limit).'),
    h('div', { class: 'form-grid' },
      field('key-models', 'Allowed models', inputs.model_allowlist, 'Comma-separated names or aliases; empty allows every model.'),
      field('key-rpm', 'Requests per minute', inputs.rpm),
      field('key-tokens-per-day', 'Tokens per day', inputs.tokens_per_day),
      field('key-max-streams', 'Max concurrent streams', inputs.max_streams),
      field('key-expires-at', 'Expires (your local time)', inputs.expires_at, 'Sent as UTC.')),
    h('details', null, h('summary', null, 'Generations limits'),
      h('div', { class: 'form-grid' },
        field('key-message-quota', 'Message quota', inputs.message_quota),
        field('key-burst-capacity', 'Burst capacity', inputs.burst_capacity),
        field('key-burst-refill-seconds', 'Burst refill (seconds)', inputs.burst_refill_seconds))),
    h('button', { type: 'submit', id: 'create-key-submit' }, 'Create key'),
    createMsg);
  root.append(
    h('div', { class: 'inline-form' }, field('keys-team', 'Team', select)), teamMsg,
    newKeyBox,
    h('h3', { id: 'keys-title', tabindex: '-1' }, 'Keys'), listMsg, tableBox, form);

  let teamId = ctx.params.get('team') || '';
  let keys = [];

  // The plaintext lives only in the <code> of this panel until Done or leaving the page.
  function clearNewKey() {
    const code = $('#new-key', newKeyBox);
    if (code) code.textContent = '';
    window.getSelection()?.removeAllRanges();
    newKeyBox.replaceChildren();
  }
  ctx.onLeave(clearNewKey);

  function showNewKey(record, plaintext) {
    const code = h('code', { id: 'new-key' }, plaintext);
    const copyMsg = msgEl('new-key-msg');
    const title = h('h3', { id: 'new-key-title', tabindex: '-1' }, `New key ${record.prefix ?? ''}`);
    const copy = async () => {
      try {
        await navigator.clipboard.writeText(code.textContent);
        say(copyMsg, 'Copied to the clipboard.');
      } catch {
        const range = document.createRange();
        range.selectNodeContents(code);
        const sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(range);
        say(copyMsg, 'Copying is not available here: the key is selected, press Ctrl+C (⌘C on a Mac).', 'warn');
      }
    };
    const done = () => {
      clearNewKey();
      $('#create-key-title', root)?.focus();
    };
    newKeyBox.replaceChildren(h('section', { id: 'new-key-panel', class: 'panel secret', 'aria-labelledby': 'new-key-title' },
      title,
      h('p', { class: 'secret-warning' }, h('strong', null, 'Copy this key now. It will not be shown again.')),
      h('p', null, code),
      h('div', { class: 'actions' },
        h('button', { type: 'button', id: 'new-key-copy', onclick: copy }, 'Copy'),
        h('button', { type: 'button', id: 'new-key-done', class: 'secondary', onclick: done }, 'Done')),
      copyMsg));
    title.focus();
  }

  function render() {
    const now = Date.now();
    tableBox.replaceChildren(table({
      id: 'keys-table',
      caption: 'Keys of the team, revoked ones included',
      columns: [{ label: 'Prefix' }, { label: 'Models' }, { label: 'Limits (rpm / tokens per day / streams)' },
        { label: 'Created' }, { label: 'Last used' }, { label: 'Expires' }, { label: 'Status' }, { label: 'Actions' }],
      empty: 'This team has no keys.',
      rowAttrs: (i) => ({ 'data-key': keys[i].id }),
      rows: keys.map((k) => {
        const st = keyStatus(k, now);
        const lim = (v) => (v == null ? 'default' : nf.format(v));
        const models = k.model_allowlist == null ? 'all'
          : k.model_allowlist.length ? k.model_allowlist.join(', ') : 'none';
        return [
          h('code', null, k.prefix),
          models,
          `${lim(k.rpm)} / ${lim(k.tokens_per_day)} / ${lim(k.max_streams)}`,
          timeEl(k.created_at),
          k.last_used_at ? timeEl(k.last_used_at) : 'never',
          k.expires_at ? timeEl(k.expires_at) : 'never',
          h('span', { class: `key-status ${st}` }, st),
          st === 'active'
            ? h('button', { type: 'button', class: 'danger revoke-key', 'data-key': k.id, onclick: () => revoke(k) },
              'Revoke', hidden(` key ${k.prefix}`))
            : '—',
        ];
      }),
    }));
  }

  async function loadKeys() {
    say(listMsg, '');
    if (!teamId) {
      keys = [];
      tableBox.replaceChildren(h('p', { class: 'muted' }, 'Choose a team to see its keys.'));
      return;
    }
    try {
      const r = await api('GET', `/admin/keys?team=${encodeURIComponent(teamId)}`);
      if (signal.aborted) return;
      keys = r.data || [];
      render();
    } catch (err) {
      tableBox.replaceChildren();
      sayError(listMsg, err);
    }
  }

  async function revoke(k) {
    if (!confirm(`Revoke key ${k.prefix}…? Requests with it are refused within 5 seconds. This cannot be undone.`)) return;
    try {
      await api('DELETE', `/admin/keys/${encodeURIComponent(k.id)}`);
      status(`Key ${k.prefix}… revoked.`);
      await loadKeys();
      $('#keys-title', root)?.focus();
    } catch (err) {
      sayError(listMsg, err);
    }
  }

  select.addEventListener('change', () => {
    teamId = select.value;
    clearNewKey();
    say(createMsg, '');
    history.replaceState(null, '', teamId ? `#/keys?team=${encodeURIComponent(teamId)}` : '#/keys');
    form.hidden = !teamId;
    loadKeys();
  });

  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    submitting(form, createMsg, async () => {
      const body = { team: Number(teamId) };
      for (const [name, input] of Object.entries(inputs)) {
        const v = input.value.trim();
        if (input.validity.badInput) throw new InputError(`${$(`label[for="${input.id}"]`, form).textContent}: enter a valid value.`, name);
        if (v === '') continue;
        if (name === 'model_allowlist') {
          const list = [...new Set(v.split(',').map((x) => x.trim()).filter(Boolean))];
          if (list.length) body.model_allowlist = list;
        } else if (name === 'expires_at') {
          const d = new Date(v);
          if (Number.isNaN(d.getTime())) throw new InputError('Enter a valid expiry time.', name);
          body.expires_at = d.toISOString().replace('.000Z', 'Z');
        } else {
          if (!/^\d+$/.test(v)) throw new InputError(`${$(`label[for="${input.id}"]`, form).textContent} must be a whole number.`, name);
          body[name] = Number(v);
        }
      }
      const record = await api('POST', '/admin/keys', body);
      let plaintext = record.key;
      delete record.key;
      form.reset();
      say(createMsg, `Key ${record.prefix ?? ''}… created.`);
      showNewKey(record, plaintext);
      plaintext = null;
      await loadKeys();
    });
  });

  try {
    const teams = await teamsList();
    if (signal.aborted) return;
    if (teamId && !teams.some((t) => String(t.id) === teamId)) teamId = '';
    teamOptions(select, teams, teamId, teams.length ? 'Choose a team' : 'No teams yet');
    form.hidden = !teamId;
    if (!teams.length) say(teamMsg, 'Create a team first (Teams page).', 'warn');
  } catch (err) {
    sayError(teamMsg, err);
  }
  await loadKeys();
}

// ---------------------------------------------------------------------------------------
// Charts (inline SVG)

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const f of [1, 2, 2.5, 5, 10]) if (f * p >= v) return f * p;
  return 10 * p;
}

function legend(series) {
  return h('ul', { class: 'legend', 'aria-label': 'Legend' }, series.map((se) => h('li', null,
    s('svg', { width: 12, height: 12, 'aria-hidden': 'true' }, s('rect', { width: 12, height: 12, fill: se.color })),
    se.name)));
}

// Vertical bars per category, each stacked bottom-up in series order.
function stackedBars({ categories, series, format, yLabel, label }) {
  const W = 760, H = 280, m = { l: 64, r: 12, t: 12, b: 48 };
  const iw = W - m.l - m.r, ih = H - m.t - m.b;
  const totals = categories.map((_, i) => series.reduce((a, se) => a + Math.max(0, se.values[i] || 0), 0));
  const max = niceMax(Math.max(0, ...totals));
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', 'aria-label': label });
  for (let k = 0; k <= 4; k++) {
    const y = m.t + ih - (ih * k) / 4;
    svg.append(s('line', { x1: m.l, x2: W - m.r, y1: y, y2: y, class: k ? 'grid' : 'axis' }),
      s('text', { x: m.l - 6, y: y + 4, 'text-anchor': 'end' }, format((max * k) / 4)));
  }
  const bw = iw / Math.max(1, categories.length);
  const step = Math.ceil(categories.length / 12);
  categories.forEach((c, i) => {
    let y = m.t + ih;
    for (const se of series) {
      const v = Math.max(0, se.values[i] || 0);
      if (!v) continue;
      const hgt = (ih * v) / max;
      y -= hgt;
      svg.append(s('rect', { x: m.l + i * bw + bw * 0.15, y, width: Math.max(1, bw * 0.7), height: hgt, fill: se.color, class: 'bar' },
        s('title', null, `${c} · ${se.name}: ${nf.format(v)}`)));
    }
    if (i % step === 0) {
      svg.append(s('text', { x: m.l + i * bw + bw / 2, y: H - m.b + 16, 'text-anchor': 'middle' }, c.slice(5)));
    }
  });
  svg.append(s('text', { x: m.l + iw / 2, y: H - 8, 'text-anchor': 'middle', class: 'axis-label' }, 'Day (UTC, month-day)'),
    s('text', { x: 14, y: m.t + ih / 2, transform: `rotate(-90 14 ${m.t + ih / 2})`, 'text-anchor': 'middle', class: 'axis-label' }, yLabel));
  return svg;
}

// Horizontal bars, one per item, labelled at the left, value at the right.
function hBars({ items, format, axisLabel, label, color = PALETTE[0] }) {
  const rowH = 26, W = 760, m = { l: 170, r: 130, t: 8, b: 40 };
  const iw = W - m.l - m.r, H = m.t + m.b + rowH * Math.max(1, items.length);
  const max = niceMax(Math.max(0, ...items.map((it) => it.value)));
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', 'aria-label': label });
  const base = H - m.b;
  for (let k = 0; k <= 4; k++) {
    const x = m.l + (iw * k) / 4;
    svg.append(s('line', { x1: x, x2: x, y1: m.t, y2: base, class: k ? 'grid' : 'axis' }),
      s('text', { x, y: base + 14, 'text-anchor': 'middle' }, format((max * k) / 4)));
  }
  items.forEach((it, i) => {
    const y = m.t + i * rowH;
    const w = (iw * Math.max(0, it.value)) / max;
    const name = it.label.length > 24 ? it.label.slice(0, 23) + '…' : it.label;
    svg.append(s('text', { x: m.l - 8, y: y + rowH / 2 + 4, 'text-anchor': 'end' }, name, s('title', null, it.label)),
      s('rect', { x: m.l, y: y + 4, width: Math.max(w, 1), height: rowH - 8, fill: color, class: 'bar' }),
      s('text', { x: m.l + w + 6, y: y + rowH / 2 + 4 }, it.text));
  });
  svg.append(s('text', { x: m.l + iw / 2, y: H - 6, 'text-anchor': 'middle', class: 'axis-label' }, axisLabel));
  return svg;
}

// A line over time: points [{t: ms, v: number|null}], null breaks the line.
function sparkline(points, { start, end, label }) {
  const W = 240, H = 48, pad = 4;
  const vals = points.map((p) => p.v).filter((v) => v != null);
  const max = Math.max(0, ...vals) || 1;
  const x = (t) => pad + ((W - 2 * pad) * (t - start)) / Math.max(1, end - start);
  const y = (v) => H - pad - ((H - 2 * pad) * v) / max;
  let d = '';
  let pen = false;
  for (const p of points) {
    if (p.v == null) {
      pen = false;
      continue;
    }
    d += `${pen ? 'L' : 'M'}${x(p.t).toFixed(1)} ${y(p.v).toFixed(1)} `;
    pen = true;
  }
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'spark', role: 'img', 'aria-label': label },
    s('line', { x1: pad, x2: W - pad, y1: H - pad, y2: H - pad, class: 'axis' }));
  if (d) svg.append(s('path', { d: d.trim(), class: 'spark-line' }));
  const last = [...points].reverse().find((p) => p.v != null);
  if (last) svg.append(s('circle', { cx: x(last.t), cy: y(last.v), r: 2.5, class: 'spark-dot' }));
  return svg;
}

// ---------------------------------------------------------------------------------------
// Usage

async function pageUsage(ctx) {
  const { root, signal } = ctx;
  const dates = dateFields('usage');
  const teamSel = h('select', { name: 'team' }, h('option', { value: '' }, 'All teams'));
  const msg = msgEl('usage-msg');
  const exportBtn = h('button', { type: 'button', id: 'usage-export', class: 'secondary' }, 'Export CSV');
  const form = h('form', { id: 'usage-form', class: 'panel inline-form', novalidate: true },
    dates.fields, field('usage-team', 'Team', teamSel),
    h('div', { class: 'actions' }, h('button', { type: 'submit', id: 'usage-submit' }, 'Show'), exportBtn),
    msg);
  const results = h('div', { id: 'usage-results' });
  root.append(form, results);

  const query = () => {
    const r = dates.read();
    const q = new URLSearchParams({ from: r.from, to: r.to });
    if (teamSel.value) q.set('team', teamSel.value);
    return { ...r, q };
  };

  async function show() {
    const f = query();
    results.replaceChildren(h('p', { class: 'muted' }, 'Loading…'));
    try {
      const r = await api('GET', '/admin/usage?' + f.q);
      if (signal.aborted) return;
      renderUsage(results, r.data || [], f);
    } catch (err) {
      results.replaceChildren();
      throw err;
    }
  }

  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    submitting(form, msg, show);
  });

  exportBtn.addEventListener('click', async () => {
    exportBtn.disabled = true;
    clearInvalid(form);
    try {
      const f = query();
      f.q.set('format', 'csv');
      const res = await api('GET', '/admin/usage?' + f.q, null, { raw: true, accept: 'text/csv' });
      const blob = new Blob([await res.blob()], { type: 'text/csv' });
      const url = URL.createObjectURL(blob);
      const name = `usage-${f.fromDay}-${f.toDay}.csv`;
      const a = h('a', { href: url, download: name, hidden: true });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
      say(msg, `Downloaded ${name}.`);
    } catch (err) {
      sayError(msg, err, form);
    } finally {
      exportBtn.disabled = false;
    }
  });

  try {
    const teams = await teamsList();
    if (signal.aborted) return;
    teamOptions(teamSel, teams, ctx.params.get('team'), 'All teams');
  } catch (err) {
    sayError(msg, err);
  }
  await submitting(form, msg, show);
}

function renderUsage(box, rows, f) {
  const days = [...new Set([...dayRange(f.fromDay, f.toDay), ...rows.map((r) => r.day)])].sort();
  const models = [...new Set(rows.map((r) => r.model))].sort();
  const tokens = new Map();
  const perTeam = new Map();
  let req = 0, tok = 0, cost = 0;
  for (const r of rows) {
    const t = (r.prompt_tokens || 0) + (r.completion_tokens || 0);
    const key = r.day + '\u0000' + r.model;
    tokens.set(key, (tokens.get(key) || 0) + t);
    const team = r.team ?? `team ${r.team_id}`;
    const e = perTeam.get(team) || { requests: 0, tokens: 0, cost: 0 };
    e.requests += r.requests || 0;
    e.tokens += t;
    e.cost += r.cost_microcredits || 0;
    perTeam.set(team, e);
    req += r.requests || 0;
    tok += t;
    cost += r.cost_microcredits || 0;
  }
  const series = models.map((m, i) => ({
    name: m, color: PALETTE[i % PALETTE.length], values: days.map((d) => tokens.get(d + '\u0000' + m) || 0),
  }));
  const teamsSorted = [...perTeam].sort((a, b) => b[1].cost - a[1].cost);
  const summary = `${nf.format(req)} requests, ${nf.format(tok)} tokens, ${credits(cost)} from ${f.fromDay} to ${f.toDay} (UTC).`;

  const tokenLabel = `Tokens per day by model. Total ${nf.format(tok)}; ` +
    series.map((se) => `${se.name}: ${nf.format(se.values.reduce((a, b) => a + b, 0))}`).join('; ');
  const costLabel = `Cost per team. Total ${credits(cost)}; ` +
    teamsSorted.map(([t, e]) => `${t}: ${credits(e.cost)}`).join('; ');

  box.replaceChildren(
    h('p', { id: 'usage-summary' }, summary),
    h('figure', { id: 'usage-tokens-chart', class: 'panel chart-box' },
      h('figcaption', null, 'Tokens per day, stacked by model (prompt + completion)'),
      rows.length ? [stackedBars({ categories: days, series, format: (v) => nfCompact.format(v), yLabel: 'Tokens', label: tokenLabel }), legend(series)]
        : h('p', { class: 'muted' }, 'No usage in this range.'),
      rows.length > 0 && h('details', null, h('summary', null, 'Chart data as a table'), table({
        caption: 'Tokens per day and model',
        columns: [{ label: 'Day (UTC)' }, ...models.map((m) => ({ label: m, num: true })), { label: 'Total', num: true }],
        rows: days.map((d, i) => [d, ...series.map((se) => num(se.values[i])),
          num(series.reduce((a, se) => a + se.values[i], 0))]),
      }))),
    h('figure', { id: 'usage-cost-chart', class: 'panel chart-box' },
      h('figcaption', null, 'Cost per team over the range'),
      rows.length ? hBars({
        items: teamsSorted.map(([t, e]) => ({ label: t, value: e.cost / 1e6, text: credits(e.cost) })),
        format: tick, axisLabel: 'Credits', label: costLabel,
      }) : h('p', { class: 'muted' }, 'No usage in this range.'),
      rows.length > 0 && table({
        caption: 'Cost per team',
        columns: [{ label: 'Team' }, { label: 'Requests', num: true }, { label: 'Tokens', num: true }, { label: 'Cost', num: true }],
        rows: teamsSorted.map(([t, e]) => [t, num(e.requests), num(e.tokens), credits(e.cost)]),
      })),
    h('h3', null, 'Usage rows'),
    table({
      id: 'usage-table',
      caption: 'Usage per UTC day, team and model',
      columns: [{ label: 'Day (UTC)' }, { label: 'Team' }, { label: 'Model' }, { label: 'Requests', num: true },
        { label: 'Prompt tokens', num: true }, { label: 'Completion tokens', num: true }, { label: 'Cost', num: true }],
      empty: 'No usage in this range.',
      rows: rows.map((r) => [r.day, r.team ?? `team ${r.team_id}`, r.model, num(r.requests), num(r.prompt_tokens),
        num(r.completion_tokens), credits(r.cost_microcredits)]),
      foot: ['Total', '', '', num(req), num(rows.reduce((a, r) => a + (r.prompt_tokens || 0), 0)),
        num(rows.reduce((a, r) => a + (r.completion_tokens || 0), 0)), credits(cost)],
    }));
}

// ---------------------------------------------------------------------------------------
// Live pages: Nodes and Queues

// Keeps box's children in the order of items, reusing each item's element by key (so focus
// and reading position survive a refresh); update(oldElement | undefined, item) -> element.
function keyedUpdate(box, cache, items, keyOf, update) {
  const seen = new Set();
  items.forEach((it, i) => {
    const k = keyOf(it);
    seen.add(k);
    const el = update(cache.get(k), it);
    cache.set(k, el);
    if (box.children[i] !== el) box.insertBefore(el, box.children[i] || null);
  });
  for (const [k, el] of cache) if (!seen.has(k)) { el.remove(); cache.delete(k); }
}

// "Updated HH:MM:SS" after a good poll (not a live region: polls are not announced).
function stamp(el, msg, extra = '') {
  const now = new Date();
  fill(el, 'Updated ', h('time', { datetime: now.toISOString(), title: utcTitle(now) }, clock.format(now)), extra);
  if (msg.classList.contains('error')) say(msg, '');
}

const NODE_COLUMNS = ['Node', 'Models', 'Owner replica', 'State', 'KV cache', 'Running', 'Waiting', 'In flight', 'Last heartbeat', 'Actions'];
const NODE_NUM = new Set([5, 6, 7]);

async function pageNodes(ctx) {
  const { root, signal } = ctx;
  const updated = h('p', { id: 'nodes-updated', class: 'muted', 'aria-live': 'off' }, 'Loading…');
  const msg = msgEl('nodes-msg');
  const tbody = h('tbody');
  const tableEl = h('table', { id: 'nodes-table' },
    h('caption', null, 'Nodes, refreshed every 2 seconds while this page is shown'),
    h('thead', null, h('tr', null, NODE_COLUMNS.map((c, i) => h('th', { scope: 'col', class: NODE_NUM.has(i) ? 'num' : null }, c)))),
    tbody);
  root.append(updated, msg, h('div', { class: 'table-wrap' }, tableEl));
  const rows = new Map(); // node_id -> <tr>, kept across polls so focus stays on its button

  async function drain(id) {
    if (!confirm(`Drain node ${id}? Running requests finish; it gets no new work. There is no undrain.`)) return;
    try {
      await api('POST', `/admin/nodes/${encodeURIComponent(id)}/drain`);
      status(`Drain requested for node ${id}.`);
      refresh();
    } catch (err) {
      sayError(msg, err);
    }
  }

  function fillRow(tr, n) {
    const cells = tr.children;
    const kv = n.kv_cache_usage;
    const flags = [];
    if (n.token_revoked) flags.push('token revoked');
    if (n.protocol_violations) flags.push(`${nf.format(n.protocol_violations)} protocol violations`);
    fill(cells[0], h('span', { class: 'node-id' }, n.node_id),
      h('span', { class: 'muted small' }, ` ${n.location ?? ''}${n.pool && n.pool !== 'unassigned' ? ' · ' + n.pool : ''}`),
      flags.length ? h('span', { class: 'flag' }, flags.join(', ')) : null);
    cells[1].textContent = (n.models || []).join(', ') || '—';
    cells[2].textContent = n.owner_replica ?? '—';
    cells[3].textContent = n.health ?? 'unknown';
    cells[3].className = `node-state ${n.health ?? ''}`;
    fill(cells[4], kv == null ? 'no data'
      : [h('meter', { min: 0, max: 1, value: kv, 'aria-hidden': 'true' }), ' ', nfPct.format(kv)]);
    cells[5].textContent = num(n.running);
    cells[6].textContent = num(n.queue_depth);
    cells[7].textContent = num(n.in_flight);
    cells[8].replaceChildren(ago(n.last_heartbeat));
    const canDrain = n.health !== 'draining' && n.health !== 'drained';
    if (!canDrain) cells[9].replaceChildren('—');
    else if (!cells[9].querySelector('button')) { // an existing button is kept: it may have focus
      cells[9].replaceChildren(h('button', { type: 'button', class: 'secondary drain-node', 'data-node': n.node_id,
        onclick: () => drain(n.node_id) }, 'Drain', hidden(` node ${n.node_id}`)));
    }
  }

  async function load() {
    try {
      const r = await api('GET', '/admin/nodes');
      if (signal.aborted) return;
      const nodes = r.data || [];
      $('.empty', tbody)?.parentElement.remove();
      keyedUpdate(tbody, rows, nodes, (n) => n.node_id, (tr, n) => {
        tr ||= h('tr', { 'data-node': n.node_id }, h('th', { scope: 'row' }),
          NODE_COLUMNS.slice(1).map((_, j) => h('td', { class: NODE_NUM.has(j + 1) ? 'num' : null })));
        fillRow(tr, n);
        return tr;
      });
      if (!nodes.length) tbody.append(h('tr', null, h('td', { colspan: NODE_COLUMNS.length, class: 'empty' }, 'No nodes registered.')));
      stamp(updated, msg);
    } catch (err) {
      sayError(msg, err);
    }
  }

  const refresh = poll(ctx, load, 2000);
}


async function pageQueues(ctx) {
  const { root, signal } = ctx;
  const updated = h('p', { id: 'queues-updated', class: 'muted', 'aria-live': 'off' }, 'Loading…');
  const msg = msgEl('queues-msg');
  const list = h('div', { id: 'queues-list', class: 'queues' });
  root.append(updated, msg, list);
  const shown = new Map(); // model -> its card

  async function load() {
    try {
      const r = await api('GET', '/admin/queues');
      if (signal.aborted) return;
      const windowMs = (r.window_seconds || 3600) * 1000;
      const models = r.data || [];
      $('.empty', list)?.remove();
      keyedUpdate(list, shown, models, (q) => q.model, (el, q) => {
        const json = JSON.stringify(q); // redraw a card only when its data changed
        if (el?.queueJson === json) return el;
        const card = queueCard(q, windowMs);
        card.queueJson = json;
        el?.replaceWith(card);
        return card;
      });
      if (!models.length) list.append(h('p', { class: 'muted empty' }, 'No model queues.'));
      stamp(updated, msg, ` · refreshed every 5 seconds; history covers ${Math.round(windowMs / 60000)} minutes`);
    } catch (err) {
      sayError(msg, err);
    }
  }

  poll(ctx, load, 5000);
}

function queueCard(q, windowMs) {
  const minutes = q.minutes || [];
  const end = Date.now();
  const start = end - windowMs;
  const pts = (k) => minutes.map((m) => ({ t: new Date(m.minute).getTime(), v: m[k] ?? null }))
    .filter((p) => Number.isFinite(p.t));
  const peak = (k) => Math.max(0, ...minutes.map((m) => m[k] ?? 0));
  const lastMin = minutes[minutes.length - 1];
  const refused = new Map();
  for (const m of minutes) {
    for (const [code, n] of Object.entries(m.refused || {})) {
      const e = refused.get(code) || { hour: 0, last: 0 };
      e.hour += n;
      if (m === lastMin) e.last += n;
      refused.set(code, e);
    }
  }
  const dispatched = minutes.reduce((a, m) => a + (m.dispatched || 0), 0);
  const nodes = Array.isArray(q.nodes) ? (q.nodes.join(', ') || 'none') : num(q.nodes);
  const lastWait = lastMin?.wait_mean_seconds;
  const id = nextId('queue');
  const depthLabel = `Queue depth (max per minute) over the last hour for ${q.model}: peak ${nf.format(peak('depth_max'))}` +
    (lastMin ? `, latest ${nf.format(lastMin.depth_max ?? 0)}` : ', no data');
  const waitLabel = `Mean wait in seconds per minute over the last hour for ${q.model}: peak ${nfDec.format(peak('wait_mean_seconds'))} s` +
    (lastWait != null ? `, latest ${nfDec.format(lastWait)} s` : '');
  return h('section', { class: 'panel queue', 'data-model': q.model, 'aria-labelledby': id },
    h('h3', { id }, q.model),
    h('dl', { class: 'facts' },
      h('div', null, h('dt', null, 'Waiting now'), h('dd', { class: 'queue-depth' }, num(q.depth))),
      h('div', null, h('dt', null, 'Nodes'), h('dd', null, nodes)),
      h('div', null, h('dt', null, 'Dispatched (hour)'), h('dd', null, num(dispatched)))),
    h('div', { class: 'sparks' },
      h('figure', null, h('figcaption', null, `Depth, max per minute (peak ${nf.format(peak('depth_max'))})`),
        sparkline(pts('depth_max'), { start, end, label: depthLabel })),
      h('figure', null, h('figcaption', null, `Mean wait, seconds (peak ${nfDec.format(peak('wait_mean_seconds'))})`),
        sparkline(pts('wait_mean_seconds'), { start, end, label: waitLabel }))),
    refused.size ? table({
      caption: 'Refusals by error code',
      columns: [{ label: 'Code' }, { label: 'Last hour', num: true },
        { label: lastMin ? `Latest minute (${hhmm.format(new Date(lastMin.minute))})` : 'Latest minute', num: true }],
      rows: [...refused].sort((a, b) => b[1].hour - a[1].hour).map(([code, e]) => [h('code', null, code), num(e.hour), num(e.last)]),
    }) : h('p', { class: 'muted' }, 'No refusals in the last hour.'));
}

// ---------------------------------------------------------------------------------------
// Reports

async function pageReports(ctx) {
  const { root, signal } = ctx;
  const dates = dateFields('reports');
  const msg = msgEl('reports-msg');
  const form = h('form', { id: 'reports-form', class: 'panel inline-form', novalidate: true },
    dates.fields, h('button', { type: 'submit', id: 'reports-submit' }, 'Show reports'), msg);
  const cost = h('section', { id: 'report-cost', 'aria-labelledby': 'report-cost-title' });
  const drift = h('section', { id: 'report-drift', 'aria-labelledby': 'report-drift-title' });
  root.append(form, cost, drift);

  async function one(box, id, title, path, q, render) {
    const m = msgEl(id + '-msg');
    box.replaceChildren(h('h3', { id: id + '-title' }, title), m, h('p', { class: 'muted' }, 'Loading…'));
    try {
      const r = await api('GET', `${path}?${q}`);
      if (signal.aborted) return;
      box.replaceChildren(h('h3', { id: id + '-title' }, title), m, render(r));
    } catch (err) {
      box.lastChild.remove();
      sayError(m, err);
    }
  }

  async function show() {
    const f = dates.read();
    const q = new URLSearchParams({ from: f.from, to: f.to });
    await Promise.all([
      one(cost, 'report-cost', 'Cost', '/admin/reports/cost', q, renderCost),
      one(drift, 'report-drift', 'Token drift', '/admin/reports/drift', q, renderDrift),
    ]);
  }

  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    submitting(form, msg, show);
  });
  await submitting(form, msg, show);
}

function renderCost(r) {
  const b = r.budget || {};
  const yes = (v) => (v ? 'yes' : 'no');
  return h('div', null,
    h('p', { class: 'muted' }, r.days ? `GPU hours cover the UTC days ${r.days[0]} to ${r.days[1]}. Figures are for operators, not billing.`
      : 'Figures are for operators, not billing.'),
    h('h4', null, `Budget, ${b.month ?? 'this month'} (UTC)`),
    h('dl', { class: 'facts', id: 'cost-budget' },
      h('div', null, h('dt', null, 'Monthly budget'), h('dd', null, b.monthly_usd == null ? 'none set' : usd(b.monthly_usd))),
      h('div', null, h('dt', null, 'Month to date'), h('dd', null, usd(b.month_to_date_usd))),
      h('div', null, h('dt', null, 'Projected'), h('dd', null, usd(b.projected_usd))),
      h('div', null, h('dt', null, 'Over budget'), h('dd', { class: b.over_budget ? 'warn-text' : null },
        b.over_budget ? 'yes: the projection exceeds the budget' : yes(false)))),
    table({
      id: 'cost-pools',
      caption: 'GPU cost by pool and model',
      columns: [{ label: 'Pool' }, { label: 'Model' }, { label: 'GPU hours', num: true }, { label: 'USD per GPU hour', num: true }, { label: 'USD', num: true }],
      empty: 'No GPU time in this range.',
      rows: (r.data || []).map((x) => [x.pool, x.model, x.gpu_hours == null ? '—' : nfDec.format(x.gpu_hours),
        x.usd_per_gpu_hour == null ? '—' : nfUsdFine.format(x.usd_per_gpu_hour), usd(x.usd)]),
    }),
    table({
      id: 'cost-models',
      caption: 'Cost and tokens by model',
      columns: [{ label: 'Model' }, { label: 'GPU hours', num: true }, { label: 'USD', num: true }, { label: 'Prompt tokens', num: true },
        { label: 'Completion tokens', num: true }, { label: 'Tokens', num: true }, { label: 'USD per million tokens', num: true }],
      empty: 'No model in this range.',
      rows: (r.models || []).map((x) => [x.model, x.gpu_hours == null ? '—' : nfDec.format(x.gpu_hours), usd(x.usd),
        num(x.prompt_tokens), num(x.completion_tokens), num(x.tokens),
        x.usd_per_million_tokens == null ? '—' : nfUsdFine.format(x.usd_per_million_tokens)]),
    }));
}

function renderDrift(r) {
  const ec = r.engine_counters || {};
  const ur = (u) => (u ? `${num(u.usage_over_bound)} / ${num(u.usage_unrepresentable)} / ${num(u.unverified_node)}` : '—');
  return h('div', null,
    h('p', null, `Engine counters compared: ${ec.compared ? 'yes' : 'no'}.`, ec.note ? ` ${ec.note}` : ''),
    table({
      id: 'drift-models',
      caption: 'Settled tokens by model (prompt / completion)',
      columns: [{ label: 'Model' }, { label: 'Settled requests', num: true }, { label: 'Settled tokens', num: true },
        { label: 'Under review (over bound / unrepresentable / unverified node)', num: true },
        { label: 'Reviewed: claimed', num: true }, { label: 'Reviewed: billed', num: true }],
      empty: 'Nothing settled in this range.',
      rows: (r.data || []).map((x) => [x.model, num(x.settled_requests), tokensPair(x.settled), ur(x.under_review),
        tokensPair(x.reviewed_claimed), tokensPair(x.reviewed_billed)]),
    }),
    r.reviewed_truncated ? h('p', { class: 'msg warn' }, 'Only the newest 100 reviewed rows are listed: narrow the range to see the others.') : null,
    table({
      id: 'drift-reviewed',
      caption: 'Rows under review, newest first (tokens as prompt / completion)',
      columns: [{ label: 'Request' }, { label: 'Team', num: true }, { label: 'Model' }, { label: 'Review' }, { label: 'Claimed', num: true },
        { label: 'Billed', num: true }, { label: 'Bounds', num: true }, { label: 'Cost', num: true }, { label: 'Settled' }],
      empty: 'No rows under review.',
      rows: (r.reviewed || []).map((x) => [h('code', null, x.request_id), num(x.team_id), x.model, x.review, tokensPair(x.claimed),
        tokensPair(x.billed), x.bounds ? tokensPair(x.bounds) : 'none', credits(x.cost_microcredits), timeEl(x.settled_at)]),
    }),
    table({
      id: 'drift-nodes',
      caption: 'Ledger against engine counters, per node, UTC day and model',
      columns: [{ label: 'Node' }, { label: 'Day (UTC)' }, { label: 'Model' }, { label: 'Ledger prompt', num: true },
        { label: 'Ledger completion', num: true }, { label: 'Engine prompt', num: true }, { label: 'Engine generation', num: true },
        { label: 'Difference', num: true }, { label: 'Ratio', num: true }],
      empty: 'No node data in this range.',
      rows: (r.nodes || []).map((x) => [x.node_id, x.day, x.model, num(x.ledger_prompt_tokens), num(x.ledger_completion_tokens),
        num(x.engine_prompt_tokens), num(x.engine_generation_tokens), num(x.difference),
        x.ratio == null ? '—' : nfRatio.format(x.ratio)]),
    }));
}

// ---------------------------------------------------------------------------------------
// Start

function start() {
  $('#signin-form').addEventListener('submit', signIn);
  $('#signout').addEventListener('click', () => {
    signOut();
    say($('#signin-error'), 'Signed out.', 'ok');
  });
  window.addEventListener('hashchange', () => route(true));
  token = sessionStorage.getItem(TOKEN_KEY);
  if (token) enterApp(false);
  else showSignIn();
}

start();
