// The attribution-graph viewer of nnsight-lorsa (nnsight_lorsa/viz/graph_viewer.py inlines this file).
// Reads the JSON in the page's element #graph-data: {graph: circuit-tracer graph JSON, details: {node_id: [block]},
// minFirstScale}. Every string from the data is set as text (textContent / attributes), never as markup,
// except detail blocks of type "html" (TrustedHTML on the Python side).
(function(){
const D = JSON.parse(document.getElementById('graph-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
const COLORS = {'lorsa':'#f58518','logit':'#e45756','cross layer transcoder':'#4c78a8','embedding':'#54a24b',
  'mlp reconstruction error':'#9d9d9d','lorsa error':'#bab0ac','bias':'#b279a2'};
const NAMES = {'lorsa':'Lorsa head','logit':'logit (output token)','cross layer transcoder':'transcoder feature',
  'embedding':'token embedding','mlp reconstruction error':'MLP error','lorsa error':'Lorsa error','bias':'bias'};
const POS = '#2ca02c', NEG = '#d62728';
const g = D.graph, tokens = D.labels || g.metadata.prompt_tokens;  // labels: characters whole
const byId = {}; g.nodes.forEach(n => byId[n.node_id] = n);
const show = t => String(t).replace(/\n/g,'\u23ce').replace(/\t/g,'\u21e5');
const num = x => (x === null || x === undefined) ? '\u2013' : (+x).toPrecision(4);
function el(tag, attrs, parent, ns){
  const e = ns ? document.createElementNS(NS, tag) : document.createElement(tag);
  for (const k in (attrs||{})) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e); return e;
}
function txt(tag, text, parent, attrs){ const e = el(tag, attrs, parent); e.textContent = text; return e; }
// rows: per layer an attention row (Lorsa heads, Lorsa errors, attention-side biases) below an MLP row,
// "E" at the bottom, logits on top; columns: bias column + one per token
const logitLayer = Math.max(-1, ...g.nodes.filter(n => n.feature_type === 'logit').map(n => +n.layer));
const isAttn = n => n.feature_type === 'lorsa' || n.feature_type === 'lorsa error' ||
  (n.feature_type === 'bias' && !/\.(mlp|transcoder)/.test(n.clerp) && +n.layer < logitLayer - 1);
const rowKey = n => n.layer === 'E' ? 'E' : n.layer + (isAttn(n) ? 'a' : 'm');
const rowOrder = k => k === 'E' ? -1 : 2 * parseInt(k) + (k.endsWith('a') ? 0 : 1);
function rowName(k){
  if (k === 'E') return 'emb';
  const s = parseInt(k);
  if (s === logitLayer) return 'logits';
  if (s === logitLayer - 1) return 'final';
  return 'L' + s + (k.endsWith('a') ? ' attn' : ' mlp');
}
const layers = [...new Set(g.nodes.map(rowKey))].sort((a,b) => rowOrder(a) - rowOrder(b));
const hasBias = g.nodes.some(n => n.feature_type === 'bias');
const col = n => n.feature_type === 'bias' ? 0 : n.ctx_idx + (hasBias ? 1 : 0);
const nCols = tokens.length + (hasBias ? 1 : 0);
const label = c => (hasBias && c === 0) ? '\u03a3 bias' : show(tokens[c - (hasBias ? 1 : 0)]);
const cells = {}, colMax = new Array(nCols).fill(1);
g.nodes.forEach(n => { const k = rowKey(n) + '|' + col(n); (cells[k] = cells[k] || []).push(n);
  colMax[col(n)] = Math.max(colMax[col(n)], cells[k].length); });
// a column is as wide as its busiest cell (up to 12 nodes side by side) and its token label need
const colW = colMax.map((m, c) => Math.max(Math.min(m, 12) * 13 + 20, Math.min(110, 7 * label(c).length + 14)));
const colX = []; { let x = 0; colW.forEach(w => { colX.push(x); x += w; }); }
const rowH = 54, left = 70, top = 20, R = 5;
const perRowOf = c => Math.max(1, Math.floor((colW[c] - 16) / 13));
// a row is as tall as its most stacked cell needs (a cell of more nodes than fit side by side stacks them 12 px
// apart): rowH for up to 3 stacked lines, so that no node is drawn inside the row of another layer
const lines = {};
for (const k in cells) {
  const layer = k.slice(0, k.lastIndexOf('|')), c = +k.slice(k.lastIndexOf('|') + 1);
  lines[layer] = Math.max(lines[layer] || 1, Math.ceil(cells[k].length / perRowOf(c)));
}
const rowHt = layers.map(l => Math.max(rowH, 12 * lines[l] + 24));
const rowTop = [];  // the rows from the top of the drawing: the last of `layers` (logits) first
{ let y = top; for (let i = layers.length - 1; i >= 0; i--) { rowTop[i] = y; y += rowHt[i]; } }
const rowBase = i => rowTop[i] + rowHt[i] - rowH / 2;  // the line of a row's first (lowest) nodes
const W = left + colW.reduce((a, b) => a + b, 0) + 20, H = top + rowHt.reduce((a, b) => a + b, 0) + 40;
const pos = {};
for (const k in cells) {
  const list = cells[k].sort((a,b) => (a.influence ?? 1) - (b.influence ?? 1));
  const [layer, c] = [k.slice(0, k.lastIndexOf('|')), +k.slice(k.lastIndexOf('|') + 1)];
  const perRow = perRowOf(c);
  list.forEach((n, i) => {
    const r = Math.floor(i / perRow), j = i % perRow, inRow = Math.min(perRow, list.length - r * perRow);
    pos[n.node_id] = [left + colX[c] + colW[c] / 2 + (j - (inRow - 1) / 2) * 13,
                      rowBase(layers.indexOf(layer)) - r * 12];
  });
}
const main = document.getElementById('main');
const svg = el('svg', {width: W, height: H, viewBox: '0 0 ' + W + ' ' + H, id: 'graph', 'data-scale': '1'},
  main, true);
svg.style.display = 'block';
layers.forEach((l, i) => {
  const y = rowBase(i);
  el('line', {x1: left, x2: W - 20, y1: y, y2: y, stroke: '#eee', class: 'row-line'}, svg, true);
});
for (let c = 1; c < nCols; c++)  // column boundaries: a wide column's outer nodes belong to its own token
  el('line', {x1: left + colX[c], x2: left + colX[c], y1: top, y2: H - 30, stroke: '#f3f3f3', class: 'col-line'},
    svg, true);
for (let c = 0; c < nCols; c++) {
  const t = el('text', {x: left + colX[c] + colW[c] / 2, y: H - 14, 'text-anchor': 'middle', class: 'token'},
    svg, true);
  t.textContent = label(c);
}
// (a loop, not Math.max(...spread): a spread of more than ~1e5 arguments throws RangeError, a blank page)
const maxAbs = (xs, floor) => xs.reduce((m, x) => Math.max(m, Math.abs(x)), floor);
const maxW = maxAbs(g.links.map(l => l.weight), 1e-30);
const linkEls = [];
const gl = el('g', {}, svg, true), gn = el('g', {}, svg, true);
g.links.forEach(l => {
  const a = pos[l.source], b = pos[l.target];
  const e = el('line', {x1: a[0], y1: a[1], x2: b[0], y2: b[1], class: 'link', 'data-source': l.source,
    'data-target': l.target, stroke: l.weight >= 0 ? POS : NEG,
    'stroke-width': (0.3 + 4 * Math.abs(l.weight) / maxW).toFixed(3), 'stroke-opacity': 0.45}, gl, true);
  linkEls.push(e);
});
// row names in a group drawn last and moved with the horizontal scroll, so they stay at the left edge
const rowLabels = el('g', {id: 'row-labels', 'pointer-events': 'none'}, null, true);
el('rect', {x: 0, y: 0, width: left - 8, height: H - 30, fill: '#fff', 'fill-opacity': 0.85},
  rowLabels, true);
layers.forEach((l, i) => {
  const y = rowBase(i) + 4;  // data-top / data-bottom: the row's band (its nodes lie inside)
  const t = el('text', {x: 6, y: y, class: 'axis', 'data-row': l, 'data-top': rowTop[i],
    'data-bottom': rowTop[i] + rowHt[i]}, rowLabels, true);
  t.textContent = rowName(l);
});
const nodeEls = {};
g.nodes.forEach(n => {
  const p = pos[n.node_id];
  const e = el('circle', {cx: p[0], cy: p[1], r: n.feature_type === 'logit' ? R + 1 : R, class: 'node',
    fill: COLORS[n.feature_type] || '#000', 'data-node-id': n.node_id, 'data-kind': n.feature_type}, gn, true);
  txt('title', n.clerp || n.node_id, e); e.addEventListener('click', () => select(n.node_id));
  nodeEls[n.node_id] = e;
});
svg.appendChild(rowLabels);
// the colour legend: every node kind (with its count in this graph), then the two edge colours
const legend = document.getElementById('legend');
const count = {}; g.nodes.forEach(n => count[n.feature_type] = (count[n.feature_type] || 0) + 1);
Object.keys(COLORS).forEach(k => {
  const s = el('span', {class: 'legend-item', 'data-kind': k}, legend);
  el('i', {style: 'background:' + COLORS[k]}, s);
  s.appendChild(document.createTextNode(NAMES[k] + ' (' + (count[k] || 0) + ')'));
});
[[POS, 'positive edge'], [NEG, 'negative edge']].forEach(([c, name]) => {
  const s = el('span', {class: 'legend-item'}, legend); el('i', {class: 'edge', style: 'background:' + c}, s);
  s.appendChild(document.createTextNode(name));
});
txt('span', 'line width \u221d |weight|', legend, {class: 'legend-item'});

// zoom: the SVG keeps its layout coordinates (viewBox) and is drawn at `scale` times their size
let scale = 1;
const zoomLevel = document.getElementById('zoom-level');
const pinLabels = () =>
  rowLabels.setAttribute('transform', 'translate(' + (main.scrollLeft / scale).toFixed(2) + ',0)');
main.addEventListener('scroll', pinLabels);
function setScale(s, ax, ay){
  s = Math.min(8, Math.max(0.05, s));
  const r0 = svg.getBoundingClientRect(), mr = main.getBoundingClientRect();
  if (ax === undefined) { ax = mr.left + main.clientWidth / 2; ay = mr.top + main.clientHeight / 2; }
  const wx = (ax - r0.left) / scale, wy = (ay - r0.top) / scale;  // the layout point under the anchor
  scale = s;
  svg.setAttribute('width', (W * s).toFixed(1)); svg.setAttribute('height', (H * s).toFixed(1));
  svg.setAttribute('data-scale', s.toFixed(4));
  const r1 = svg.getBoundingClientRect();
  main.scrollLeft += wx * s - (ax - r1.left); main.scrollTop += wy * s - (ay - r1.top);
  if (zoomLevel) zoomLevel.textContent = Math.round(100 * s) + '%';
  pinLabels();
}
const fitScale = () => Math.max(0.05, (main.clientWidth - 8) / W);
const button = (id, f) => { const b = document.getElementById(id); if (b) b.addEventListener('click', f); };
button('zoom-fit', () => { setScale(fitScale()); main.scrollLeft = 0; });
button('zoom-in', () => setScale(scale * 1.25));
button('zoom-out', () => setScale(scale / 1.25));
button('zoom-reset', () => setScale(1));
main.addEventListener('wheel', e => {  // Ctrl + wheel (a trackpad pinch sends the same) zooms at the pointer
  if (!e.ctrlKey && !e.metaKey) return;
  e.preventDefault();
  setScale(scale * Math.exp(-e.deltaY * 0.002), e.clientX, e.clientY);
}, {passive: false});
function reveal(id){  // scroll the node into the middle of the view
  const r = nodeEls[id].getBoundingClientRect(), mr = main.getBoundingClientRect();
  main.scrollLeft += r.left + r.width / 2 - (mr.left + main.clientWidth / 2);
  main.scrollTop += r.top + r.height / 2 - (mr.top + main.clientHeight / 2);
}
function edgeTable(title, list, key, panel){
  txt('h3', title, panel);
  const t = el('table', {class: 'edges'}, panel);
  list.sort((a,b) => Math.abs(b.weight) - Math.abs(a.weight)).slice(0, 10).forEach(l => {
    const tr = el('tr', {}, t), other = byId[l[key]];
    const a = txt('a', other ? (other.clerp || other.node_id) : l[key], el('td', {}, tr));
    a.addEventListener('click', () => select(l[key]));
    txt('td', num(l.weight), tr, {class: 'num'});
  });
  if (!list.length) txt('p', 'none', panel);
}
function block(b, panel){
  if (b.type === 'html') { const d = el('div', {class: 'detail-html'}, panel); d.innerHTML = b.html; return; }
  if (b.type === 'text') { txt('pre', b.text, panel, {class: 'detail-text'}); return; }
  if (b.title) txt('h3', b.title, panel);
  if (b.type === 'contexts') {
    const t = el('table', {class: 'contexts'}, panel);
    const m = maxAbs(b.rows.map(r => r[1]), 1e-30);
    b.rows.forEach(r => { const tr = el('tr', {}, t);
      const shade = (0.6 * Math.abs(r[1]) / m).toFixed(3);
      txt('td', show(r[0]), tr, {class: 'ctx', style: 'background:rgba(245,133,24,' + shade + ')'});
      txt('td', num(r[1]), tr, {class: 'num'}); });
  } else if (b.type === 'heatmap') {
    const t = el('table', {class: 'heat'}, panel);
    const m = maxAbs(b.values.flat().filter(v => v !== null), 1e-30);
    const hr = el('tr', {}, t); el('td', {}, hr); b.cols.forEach(c => txt('td', show(c), hr, {class: 'axis'}));
    b.values.forEach((row, i) => { const tr = el('tr', {}, t); txt('td', show(b.rows[i]), tr, {class: 'axis'});
      row.forEach((v, j) => { const a = v === null ? 0 : Math.abs(v) / m;
        const c = v !== null && v < 0 ? '214,39,40' : '31,119,180';
        txt('td', '', tr, {style: 'background:rgba(' + c + ',' + a.toFixed(3) + ')',
          title: show(b.rows[i]) + ' \u2192 ' + show(b.cols[j]) + ': ' + num(v)}); }); });
  }
}
function select(id){
  const n = byId[id], panel = document.getElementById('panel');
  if (!n) return;
  panel.textContent = '';
  Object.values(nodeEls).forEach(e => e.classList.remove('sel')); nodeEls[id].classList.add('sel');
  linkEls.forEach(e => e.classList.toggle('dim', e.dataset.source !== id && e.dataset.target !== id));
  txt('h2', n.clerp || n.node_id, panel, {id: 'panel-title'});
  const t = el('table', {class: 'props'}, panel);
  const tok = n.feature_type === 'bias' ? '(all positions)' : show(tokens[n.ctx_idx]);
  [['node_id', n.node_id], ['type', n.feature_type], ['layer', n.layer], ['position', n.ctx_idx + ' ' + tok],
   ['activation', num(n.activation)], ['influence (cumulative)', num(n.influence)]].concat(
   n.feature_type === 'logit' ? [['probability', num(n.token_prob)]] : []).forEach(([k, v]) => {
    const tr = el('tr', {}, t); txt('th', k, tr); txt('td', String(v), tr, {class: 'prop-' + k.split(' ')[0]}); });
  edgeTable('Incoming', g.links.filter(l => l.target === id), 'source', panel);
  edgeTable('Outgoing', g.links.filter(l => l.source === id), 'target', panel);
  (D.details[id] || []).forEach(b => block(b, panel));
  const h = '#node=' + encodeURIComponent(id);
  if (location.hash !== h) { try { history.replaceState(null, '', h); } catch (e) { /* opaque origin */ } }
}
function click(id){ if (nodeEls[id]) nodeEls[id].dispatchEvent(new MouseEvent('click', {bubbles: true})); }
function fromHash(){
  const m = /^#node=(.+)$/.exec(location.hash);
  if (m) { const id = decodeURIComponent(m[1]); click(id); if (nodeEls[id]) reveal(id); return true; }
  return false;
}
// first paint: fitted to the width if nodes stay readable, else readable and scrolled to the right end,
// where the logits and the last positions' Lorsa heads sit
const fit = fitScale(), minFirst = +D.minFirstScale || 0.6;
setScale(fit >= minFirst ? Math.min(fit, 1.5) : minFirst);
main.scrollLeft = main.scrollWidth; main.scrollTop = 0;
pinLabels();
window.addEventListener('hashchange', fromHash);
if (!fromHash() && g.qParams.clickedId) { click(g.qParams.clickedId); reveal(g.qParams.clickedId); }
document.body.setAttribute('data-ready', '1');
})();
