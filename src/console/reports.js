// Switchyard console: the Reports page. The cost report (GPU hours, budget, cost per model)
// and the token drift report (ledger against claims and engine counters) over a date range.

import {
  h, msgEl, sayError, submitting, table, nfDec, nfUsdFine, nfRatio, num, usd, credits, tokensPair,
  timeEl, dateFields, api
} from '/console/ui.js';

export async function pageReports(ctx) {
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
