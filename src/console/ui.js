// Switchyard console: shared helpers. DOM building (createElement / createElementNS and
// textContent only, never HTML strings), number and time formatting, the admin API client,
// and the session state (credential, page on screen) that every module reads from here.

const SVGNS = 'http://www.w3.org/2000/svg';

// The session, held here only: the admin credential (also in sessionStorage; never shown or
// logged) and the page on screen ({ ctl: AbortController, cleanups: [] }), whose signal
// api() passes on. app.js sets both.
export const session = { token: null, view: null };

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

export const h = (tag, attrs, ...children) => append(setAttrs(document.createElement(tag), attrs), children);
export const s = (tag, attrs, ...children) => append(setAttrs(document.createElementNS(SVGNS, tag), attrs), children);
export const fill = (el, ...children) => append((el.replaceChildren(), el), children);
export const $ = (sel, root = document) => root.querySelector(sel);
export const hidden = (text) => h('span', { class: 'visually-hidden' }, text);
let uid = 0;
export const nextId = (prefix) => `${prefix}-${++uid}`;

export function field(id, label, input, hint) {
  input.id = id;
  if (hint) input.setAttribute('aria-describedby', id + '-hint');
  return h('div', { class: 'field' }, h('label', { for: id }, label), input,
    hint && h('p', { class: 'hint', id: id + '-hint' }, hint));
}

export const msgEl = (id) => h('p', { class: 'msg', id, 'aria-live': 'polite' });

export function say(el, text, kind = 'ok') {
  if (el.textContent === text && el.classList.contains(kind)) return; // do not re-announce
  el.className = 'msg ' + kind;
  el.textContent = text;
}

export const status = (text) => say($('#status'), text);

// Shows an API error in text next to what caused it; marks the field `param` names.
export function sayError(el, err, form) {
  if (!err || err.name === 'AbortError' || err.status === 401) return;
  say(el, 'Error: ' + (err.message || String(err)), 'error');
  if (form && err.param) {
    const input = form.elements[String(err.param).split(/[[.]/)[0]];
    input?.setAttribute?.('aria-invalid', 'true');
    input?.closest?.('details')?.setAttribute('open', '');
    input?.focus?.();
  }
}

export function clearInvalid(form) {
  for (const el of form.querySelectorAll('[aria-invalid]')) el.removeAttribute('aria-invalid');
}

// Runs a form's action with its submit button disabled; errors go to `msg`.
export async function submitting(form, msg, fn) {
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
export class InputError extends Error {
  constructor(message, param) { super(message); this.param = param; }
}

// A table: columns [{label, num}], rows of cells (string | Node); the first cell of each
// row is a row header.
export function table({ id, caption, columns, rows, empty = 'Nothing to show.', foot, rowAttrs }) {
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

export const nf = new Intl.NumberFormat();
export const nfDec = new Intl.NumberFormat(undefined, { maximumFractionDigits: 2 });
export const nfCompact = new Intl.NumberFormat(undefined, { notation: 'compact', maximumFractionDigits: 1 });
// Axis ticks: compact for large values, a few significant digits for small ones (costs of a
// few microcredits would otherwise all read 0).
const nfSig = new Intl.NumberFormat(undefined, { maximumSignificantDigits: 3 });
export const tick = (v) => (Math.abs(v) >= 1000 ? nfCompact.format(v) : nfSig.format(v));
const nfCredits = new Intl.NumberFormat(undefined, { minimumFractionDigits: 2, maximumFractionDigits: 6 });
export const nfPct = new Intl.NumberFormat(undefined, { style: 'percent', maximumFractionDigits: 0 });
const nfUsd = new Intl.NumberFormat(undefined, { style: 'currency', currency: 'USD' });
export const nfUsdFine = new Intl.NumberFormat(undefined, { style: 'currency', currency: 'USD', maximumFractionDigits: 4 });
export const nfRatio = new Intl.NumberFormat(undefined, { minimumFractionDigits: 2, maximumFractionDigits: 4 });
const dtf = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });
export const hhmm = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit', hourCycle: 'h23' });
export const clock = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit', second: '2-digit', hourCycle: 'h23' });

export const num = (v) => (v == null ? '—' : nf.format(v));
export const usd = (v) => (v == null ? '—' : nfUsd.format(v));
export const credits = (micro) => (micro == null ? '—' : `${nfCredits.format(micro / 1e6)} credits`);
const pair = (o, a, b) => (o ? `${num(o[a])} / ${num(o[b])}` : '—');
export const tokensPair = (o) => pair(o, 'prompt_tokens', 'completion_tokens');

export const utcTitle = (d) => 'UTC ' + d.toISOString().replace('.000Z', 'Z');

// A <time> in the browser's local time, the UTC instant in its title.
export function timeEl(iso, text) {
  if (!iso) return '—';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return h('time', { datetime: d.toISOString(), title: utcTitle(d) }, text ?? dtf.format(d));
}

export function ago(iso) {
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
export function dayRange(from, to) {
  const out = [];
  for (let d = from; d <= to && out.length < 1000; d = addDays(d, 1)) out.push(d);
  return out;
}

// Two <input type=date> fields (inclusive UTC days) -> the half-open RFC 3339 range [from, to).
export function dateFields(prefix, days = 7) {
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

export class ApiError extends Error {
  constructor(status, message, code, param) {
    super(message);
    Object.assign(this, { name: 'ApiError', status, code: code ?? null, param: param ?? null });
  }
}

// What a 401 does (outside signing in): app.js sets it to sign out.
let unauthorized = () => {};
export const onUnauthorized = (fn) => { unauthorized = fn; };

// One call to the admin API with the credential. Answers the parsed JSON (or the Response,
// with opts.raw); throws ApiError with the envelope's message. A 401 signs out, except
// while signing in.
export async function api(method, path, body, opts = {}) {
  const headers = { Accept: opts.accept || 'application/json', Authorization: 'Bearer ' + (opts.token ?? session.token) };
  const init = { method, headers, cache: 'no-store', credentials: 'same-origin', redirect: 'error' };
  const signal = 'signal' in opts ? opts.signal : session.view?.ctl.signal;
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
    unauthorized('Your session has ended or the credential is no longer accepted. Sign in again.');
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

export const teamsList = async () => (await api('GET', '/admin/teams')).data || [];

export function teamOptions(select, teams, selected, first) {
  select.replaceChildren(h('option', { value: '' }, first));
  for (const t of teams) {
    select.append(h('option', { value: t.id, selected: String(t.id) === String(selected) },
      `${t.name} (id ${t.id})`));
  }
}
