// Switchyard console: the Usage page. Settled usage per UTC day, team and model over a date
// range, as charts, tables and a CSV export.

import {
  h, field, msgEl, say, sayError, clearInvalid, submitting, table, nf, nfCompact, tick, num,
  credits, dayRange, dateFields, api, teamsList, teamOptions
} from '/console/ui.js';
import { PALETTE, legend, stackedBars, hBars } from '/console/charts.js';

export async function pageUsage(ctx) {
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
