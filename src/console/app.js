// Switchyard operator console: the entry module (sign-in, sign-out, routing, start). Plain ES
// modules, no dependencies, under a strict CSP: every DOM node is built with createElement /
// createElementNS and textContent, never from HTML strings; API strings are untrusted text.

import { $, h, msgEl, say, sayError, api, ApiError, session, onUnauthorized } from '/console/ui.js';
import { pageTeams } from '/console/teams.js';
import { pageKeys } from '/console/keys.js';
import { pageUsage } from '/console/usage.js';
import { pageNodes, pageQueues } from '/console/live.js';
import { pageReports } from '/console/reports.js';

const TOKEN_KEY = 'switchyard.console.token';

// ---------------------------------------------------------------------------------------
// Sign-in, sign-out, routing

function showSignIn(message) {
  toggleSignedIn(false);
  document.title = 'Sign in · Switchyard console';
  say($('#signin-error'), message || '', 'error');
  $('#signin-token').focus();
}

function signOut(message) {
  session.token = null;
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
    session.token = candidate;
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
  const view = session.view;
  if (!view) return;
  view.ctl.abort();
  for (const fn of view.cleanups) try { fn(); } catch { /* a cleanup must not stop the others */ }
  session.view = null;
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
  if (!session.token) return;
  const m = /^#\/([a-z]+)(?:\?(.*))?$/.exec(location.hash);
  let name = m && m[1];
  const params = new URLSearchParams((m && m[2]) || '');
  if (!Object.hasOwn(PAGES, name)) {
    name = 'teams';
    history.replaceState(null, '', '#/teams');
  }
  leaveView();
  const v = { ctl: new AbortController(), cleanups: [] };
  session.view = v;
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

// ---------------------------------------------------------------------------------------
// Start

function start() {
  $('#signin-form').addEventListener('submit', signIn);
  $('#signout').addEventListener('click', () => {
    signOut();
    say($('#signin-error'), 'Signed out.', 'ok');
  });
  window.addEventListener('hashchange', () => route(true));
  onUnauthorized(signOut);
  session.token = sessionStorage.getItem(TOKEN_KEY);
  if (session.token) enterApp(false);
  else showSignIn();
}

start();
