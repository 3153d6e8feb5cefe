// Switchyard console: the Keys page. A team's API keys with their limits and status; creates
// a key (its plaintext shown once, then forgotten) and revokes keys.

import {
  $, h, hidden, field, msgEl, say, status, sayError, submitting, InputError, table, nf, timeEl,
  api, teamsList, teamOptions
} from '/console/ui.js';

function keyStatus(k, now = Date.now()) {
  if (k.revoked_at) return 'revoked';
  if (k.expires_at && new Date(k.expires_at).getTime() <= now) return 'expired';
  return 'active';
}

export async function pageKeys(ctx) {
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
