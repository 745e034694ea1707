// kvserve dashboard: draws the frames of /dashboard/events (server/dashboard.py builds them).
//
// A frame: {num_blocks, block_size, kv_format, map, counts: {free, cached, used, shared}, running,
//   waiting, tokens_per_s, generation_tokens_per_s, prefix_hit_rate, prefix_hit_rate_interval,
//   requests: [{id, blocks, table}], requests_omitted, tiers: [{name, unit, used, cached?, capacity,
//   hit_rate}]}   or {error}.
// map: base64 of little-endian uint32 runs, (length << 2) | state, covering the pool in block order.
// table: base64 of uint32 pairs (first block id, length) of consecutive ids.
// Besides the canvas, #kvmap carries the counts per state, the shared block ids (up to
// SHARED_IDS_MAX) and, for pools of up to STATES_MAX blocks, every block's state as digits.
"use strict";

const STATES = ["free", "cached", "used", "shared"];
const COLORS = [[255, 255, 255], [158, 202, 225], [253, 141, 60], [165, 15, 21]];
const SHARED_IDS_MAX = 1024, STATES_MAX = 4096, HISTORY = 240, MAP_WIDTH = 960, MAP_HEIGHT_MAX = 480;

const $ = (id) => document.getElementById(id);
const canvas = $("kvmap"), tip = $("tip");
let states = new Uint8Array(0), owners = new Map(), layout = {cols: 1, cell: 1};
const history = [];
let frames = 0;

function bytes(b64) {
  const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return new DataView(out.buffer);
}

function decodeMap(b64, n) {
  const v = bytes(b64), out = new Uint8Array(n);
  let at = 0;
  for (let i = 0; i + 4 <= v.byteLength; i += 4) {
    const w = v.getUint32(i, true), len = w >>> 2;
    out.fill(w & 3, at, at + len);
    at += len;
  }
  return out;
}

function decodeRuns(b64) {  // [[first, length], ...]
  const v = bytes(b64), out = [];
  for (let i = 0; i + 8 <= v.byteLength; i += 8) out.push([v.getUint32(i, true), v.getUint32(i + 4, true)]);
  return out;
}

function drawMap(n) {
  // Square cells, as large as fit MAP_WIDTH x MAP_HEIGHT_MAX (one pixel each at worst).
  const cell = Math.max(1, Math.floor(Math.sqrt((MAP_WIDTH * MAP_HEIGHT_MAX) / Math.max(n, 1))));
  const cols = Math.max(1, Math.floor(MAP_WIDTH / cell)), rows = Math.max(1, Math.ceil(n / cols));
  layout = {cols, cell};
  canvas.width = cols * cell;
  canvas.height = rows * cell;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (cell >= 4) {  // large cells: one rectangle each, with a gap so single blocks stand out
    for (let b = 0; b < n; b++) {
      const c = COLORS[states[b]];
      ctx.fillStyle = `rgb(${c[0]},${c[1]},${c[2]})`;
      ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - 1, cell - 1);
    }
    return;
  }
  const img = new ImageData(cols, rows), px = img.data;  // one pixel per block, scaled up
  for (let b = 0; b < n; b++) {
    const c = COLORS[states[b]], o = b * 4;
    px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
  }
  const small = new OffscreenCanvas(cols, rows);
  small.getContext("2d").putImageData(img, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(small, 0, 0, cols * cell, rows * cell);
}

function mark(counts, n) {
  const d = canvas.dataset;
  d.numBlocks = n;
  for (const s of STATES) { d[s] = counts[s]; $("count-" + s).textContent = counts[s].toLocaleString(); }
  const shared = [];
  for (let b = 0; b < n && shared.length < SHARED_IDS_MAX; b++) if (states[b] === 3) shared.push(b);
  d.sharedIds = shared.join(" ");
  if (n <= STATES_MAX) d.states = Array.from(states).join(""); else delete d.states;
}

function fmt(x, digits = 1) { return x === null || x === undefined ? "–" : x.toFixed(digits); }
function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
function size(x, unit) {
  if (x === null || x === undefined) return "–";
  if (unit === "blocks") return x.toLocaleString();
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
  return x.toFixed(i ? 1 : 0) + " " + u[i];
}

function cell(tr, text) { const td = document.createElement("td"); td.textContent = text; tr.appendChild(td); return td; }

function drawTiers(tiers) {
  const body = $("tiers").tBodies[0];
  body.replaceChildren();
  for (const t of tiers) {
    const tr = document.createElement("tr");
    tr.dataset.tier = t.name;
    cell(tr, t.name.toUpperCase());
    const bar = document.createElement("span");
    bar.className = "bar";
    const cap = t.capacity || 0, used = t.used || 0, cached = t.cached || 0;
    for (const [cls, from, w] of [["u", 0, used], ["c", used, cached]]) {
      const s = document.createElement("span");
      s.className = cls;
      s.style.left = cap ? (100 * from / cap) + "%" : "0";
      s.style.width = cap ? (100 * w / cap) + "%" : "0";
      bar.appendChild(s);
    }
    cell(tr, "").appendChild(bar);
    cell(tr, `${size(t.used, t.unit)}${t.cached ? " + " + size(t.cached, t.unit) + " cached" : ""} / ${size(t.capacity, t.unit)}`);
    cell(tr, pct(t.hit_rate));
    body.appendChild(tr);
  }
}

function drawRequests(reqs, omitted) {
  owners = new Map();
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  for (const r of reqs) {
    const runs = decodeRuns(r.table);
    for (const [first, len] of runs) {
      for (let b = first; b < first + len; b++) {
        const o = owners.get(b);
        if (o) o.push(r.id); else owners.set(b, [r.id]);
      }
    }
    const tr = document.createElement("tr");
    tr.dataset.request = r.id;
    cell(tr, r.id);
    cell(tr, r.blocks);
    const text = runs.map(([f, l]) => (l > 1 ? `${f}-${f + l - 1}` : `${f}`)).join(", ");
    cell(tr, text.length > 160 ? text.slice(0, 160) + " …" : text);
    body.appendChild(tr);
  }
  $("omitted").textContent = omitted ? `(${omitted} more not shown)` : "";
}

function drawHistory() {
  const c = $("history"), ctx = c.getContext("2d"), w = c.width, h = c.height;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#ddd";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
  const maxTps = Math.max(1, ...history.map((p) => p.tps || 0));
  const line = (key, scale, color) => {
    ctx.strokeStyle = color;
    ctx.beginPath();
    let started = false;
    history.forEach((p, i) => {
      if (p[key] === null || p[key] === undefined) { started = false; return; }
      const x = (i / (HISTORY - 1)) * (w - 2) + 1, y = h - 1 - (p[key] / scale) * (h - 2);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  };
  line("hit", 1, "#3182bd");
  line("tps", maxTps, "#31a354");
  ctx.fillStyle = "#555";
  ctx.fillText(`${maxTps.toFixed(0)} tok/s`, 4, 12);
}

function onFrame(f) {
  const st = $("status");
  if (f.error) { st.textContent = f.error; st.className = "down"; return; }
  frames++;
  st.dataset.frames = frames;
  st.className = "";
  st.textContent = `live · ${new Date(f.time * 1000).toLocaleTimeString()}`;
  states = decodeMap(f.map, f.num_blocks);
  drawMap(f.num_blocks);
  mark(f.counts, f.num_blocks);
  $("map-size").textContent = `${f.num_blocks.toLocaleString()} blocks × ${f.block_size} tokens`;
  $("kv-format").textContent = f.kv_format;
  $("running").textContent = f.running;
  $("waiting").textContent = f.waiting;
  $("tokens-per-s").textContent = `${fmt(f.tokens_per_s)} (${fmt(f.generation_tokens_per_s)})`;
  $("hit-rate").textContent = pct(f.prefix_hit_rate);
  drawTiers(f.tiers);
  drawRequests(f.requests, f.requests_omitted);
  history.push({hit: f.prefix_hit_rate_interval, tps: f.tokens_per_s});
  if (history.length > HISTORY) history.shift();
  drawHistory();
}

canvas.addEventListener("mousemove", (e) => {
  const r = canvas.getBoundingClientRect();
  const x = (e.clientX - r.left) * (canvas.width / r.width), y = (e.clientY - r.top) * (canvas.height / r.height);
  const b = Math.floor(y / layout.cell) * layout.cols + Math.floor(x / layout.cell);
  if (b < 0 || b >= states.length || x >= layout.cols * layout.cell) { tip.hidden = true; return; }
  const who = owners.get(b);
  tip.textContent = `block ${b}: ${STATES[states[b]]}` + (who ? "\n" + who.join("\n") : "");
  tip.style.left = (e.clientX - r.left + 12) + "px";
  tip.style.top = (e.clientY - r.top + 12) + "px";
  tip.hidden = false;
});
canvas.addEventListener("mouseleave", () => { tip.hidden = true; });

const events = new EventSource("/dashboard/events");
events.onmessage = (e) => onFrame(JSON.parse(e.data));
events.onerror = () => { $("status").textContent = "disconnected; retrying…"; $("status").className = "down"; };
