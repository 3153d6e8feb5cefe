// Switchyard console: the live pages, Nodes and Queues, refreshed by polling while shown;
// rows and cards are updated in place so focus and reading position survive a refresh.

import {
  $, h, fill, hidden, nextId, msgEl, say, status, sayError, table, nf, nfDec, nfPct, hhmm, clock,
  num, utcTitle, ago, api
} from '/console/ui.js';
import { sparkline } from '/console/charts.js';

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

export async function pageNodes(ctx) {
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

export async function pageQueues(ctx) {
  const { root, signal } = ctx;
  const updated = h('p', { id: 'queues-updated', class: 'muted', 'aria-live': 'off' }, 'Loading…');
  const msg = msgEl('queues-msg');
  const list = h('div', { id: 'queues-list', class: 'queues' });
  const early = h('div', { id: 'queues-before-model' });
  root.append(updated, msg, list, early);
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
      fill(early, beforeModel(r.before_model || []));
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
      h('div', null, h('dt', null, 'By tier'), h('dd', { class: 'queue-tiers' }, tiers(q.waiting_by_tier))),
      h('div', null, h('dt', null, 'Nodes'), h('dd', null, nodes)),
      h('div', null, h('dt', null, 'Dispatched (hour)'), h('dd', null, num(dispatched)))),
    h('div', { class: 'sparks' },
      h('figure', null, h('figcaption', null, `Depth, max per minute (peak ${nf.format(peak('depth_max'))})`),
        sparkline(pts('depth_max'), { start, end, label: depthLabel })),
      h('figure', null, h('figcaption', null, `Mean wait, seconds (peak ${nfDec.format(peak('wait_mean_seconds'))})`),
        sparkline(pts('wait_mean_seconds'), { start, end, label: waitLabel }))),
    refusals(minutes, 'Refusals by error code'));
}

// Waiting requests by service tier ("priority 0 · default 3 · flex 12"), as the owner's line
// holds them.
function tiers(byTier) {
  if (!byTier) return '—';
  return ['priority', 'default', 'flex'].map((t) => `${t} ${num(byTier[t])}`).join(' · ');
}

// The requests refused by code over the hour and in its latest minute, as a table.
function refusals(minutes, caption) {
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
  if (!refused.size) return h('p', { class: 'muted' }, 'No refusals in the last hour.');
  return table({
    caption,
    columns: [{ label: 'Code' }, { label: 'Last hour', num: true },
      { label: lastMin ? `Latest minute (${hhmm.format(new Date(lastMin.minute))})` : 'Latest minute', num: true }],
    rows: [...refused].sort((a, b) => b[1].hour - a[1].hour).map(([code, e]) => [h('code', null, code), num(e.hour), num(e.last)]),
  });
}

// Requests refused before a model was known: authentication, rate and token limits,
// malformed bodies — where a throttled key shows first.
function beforeModel(minutes) {
  return h('section', { class: 'panel', 'aria-labelledby': 'before-model-title' },
    h('h3', { id: 'before-model-title' }, 'Refused before a model was chosen'),
    h('p', { class: 'hint' }, 'Authentication, rate and token limits, malformed requests.'),
    refusals(minutes, 'Refusals before a model, by error code'));
}
