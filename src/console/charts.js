// Switchyard console: charts drawn as inline SVG (stacked bars, horizontal bars, sparklines),
// built node by node like the rest of the page; each chart has a text label for screen readers.

import { h, s, nf } from '/console/ui.js';

// Distinguishable series colours, each at least 3:1 against white (legend order = stack order).
export const PALETTE = ['#1f5fa8', '#b35c00', '#2e7d32', '#7b3fa0', '#b3261e', '#00796b', '#6d6200', '#4d4d4d'];

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const f of [1, 2, 2.5, 5, 10]) if (f * p >= v) return f * p;
  return 10 * p;
}

export function legend(series) {
  return h('ul', { class: 'legend', 'aria-label': 'Legend' }, series.map((se) => h('li', null,
    s('svg', { width: 12, height: 12, 'aria-hidden': 'true' }, s('rect', { width: 12, height: 12, fill: se.color })),
    se.name)));
}

// Vertical bars per category, each stacked bottom-up in series order.
export function stackedBars({ categories, series, format, yLabel, label }) {
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
export function hBars({ items, format, axisLabel, label, color = PALETTE[0] }) {
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
export function sparkline(points, { start, end, label }) {
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
