// Switchyard console: the Teams page. Lists the teams with their balances, creates teams,
// and adds or corrects a team's credits with its credit history.

import {
  $, h, hidden, field, msgEl, say, sayError, submitting, InputError, table, credits, timeEl, api,
  teamsList
} from '/console/ui.js';

export async function pageTeams(ctx) {
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
