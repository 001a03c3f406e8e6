"use strict";
// Small canvas charts: a time-series line chart (optionally stacked) and a bar chart. They hold
// their own points and redraw on every push; NaN is a gap.

const PALETTE = ["#4e9af1", "#f2a541", "#5cc98a", "#e5606b", "#b48ef0", "#41c6d6", "#e07fc1",
  "#c9c95c", "#9aa5b1"];

function formatValue(v, unit) {
  if (v === undefined || Number.isNaN(v)) return "–";
  const abs = Math.abs(v);
  let text;
  if (abs >= 1e6) text = `${(v / 1e6).toFixed(1)}M`;
  else if (abs >= 1e4) text = `${(v / 1e3).toFixed(1)}k`;
  else if (abs >= 100 || Number.isInteger(v)) text = v.toFixed(0);
  else if (abs >= 10) text = v.toFixed(1);
  else if (abs >= 1) text = v.toFixed(2);
  else text = v.toPrecision(2);
  return unit ? `${text} ${unit}` : text;
}

// Round step (1, 2, 5 x 10^k) so that about `ticks` of them cover max.
function niceStep(max, ticks) {
  const raw = max / ticks;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / mag;
  return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
}

function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.round(canvas.clientWidth * ratio));
  const h = Math.max(1, Math.round(canvas.clientHeight * ratio));
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, w: canvas.clientWidth, h: canvas.clientHeight };
}

const PAD = { left: 52, right: 10, top: 8, bottom: 20 };

function drawAxes(ctx, w, h, yMax, unit) {
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#8b949e";
  ctx.strokeStyle = "#30363d";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const step = niceStep(yMax, 4);
  for (let y = 0; y <= yMax + step * 1e-9; y += step) {
    const py = h - PAD.bottom - (y / yMax) * (h - PAD.top - PAD.bottom);
    ctx.beginPath();
    ctx.moveTo(PAD.left, Math.round(py) + 0.5);
    ctx.lineTo(w - PAD.right, Math.round(py) + 0.5);
    ctx.stroke();
    ctx.fillText(formatValue(y, ""), PAD.left - 6, py);
  }
  if (unit) {
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillText(unit, PAD.left + 4, PAD.top + 2);
  }
}

class LineChart {
  // options: {unit, stacked, spanS, series: [{key, label}], yMin (smallest y range)}
  constructor(canvas, legend, options) {
    this.canvas = canvas;
    this.legend = legend;
    this.unit = options.unit || "";
    this.stacked = Boolean(options.stacked);
    this.spanS = options.spanS || 300;
    this.yMin = options.yMin || 1e-9;
    this.series = [];
    this.points = [];  // [{t, values: {key: number}}]
    for (const s of options.series || []) this.ensureSeries(s.key, s.label);
  }

  ensureSeries(key, label) {
    if (!this.series.some((s) => s.key === key)) {
      this.series.push({ key, label: label || key, color: PALETTE[this.series.length % PALETTE.length] });
    }
  }

  push(t, values) {
    this.points.push({ t, values });
    while (this.points.length && this.points[0].t < t - this.spanS) this.points.shift();
    this.draw();
    this.drawLegend(values);
  }

  // y of each series at each point; stacked charts add the ones below (a NaN counts as 0).
  stackedValues(point) {
    const out = {};
    let base = 0;
    for (const s of this.series) {
      const v = point.values[s.key];
      if (this.stacked) {
        base += Number.isNaN(v) || v === undefined ? 0 : v;
        out[s.key] = base;
      } else {
        out[s.key] = v === undefined ? NaN : v;
      }
    }
    return out;
  }

  draw() {
    const { ctx, w, h } = fitCanvas(this.canvas);
    ctx.clearRect(0, 0, w, h);
    const ys = this.points.map((p) => this.stackedValues(p));
    let top = 1e-9;
    for (const row of ys) for (const v of Object.values(row)) if (v > top) top = v;
    top = Math.max(top * 1.1, this.yMin);
    const step = niceStep(top, 4);
    const yMax = step * Math.ceil(top / step - 1e-9);
    drawAxes(ctx, w, h, yMax, this.unit);
    const now = this.points.length ? this.points[this.points.length - 1].t : 0;
    const x = (t) => PAD.left + ((t - (now - this.spanS)) / this.spanS) * (w - PAD.left - PAD.right);
    const y = (v) => h - PAD.bottom - (v / yMax) * (h - PAD.top - PAD.bottom);
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    ctx.fillStyle = "#8b949e";
    const tick = [5, 10, 15, 30, 60, 120, 300, 600, 900].find((s) => this.spanS / s <= 5) || 1800;
    for (let back = 0; back <= this.spanS; back += tick) {
      const label = back === 0 ? "now" : back % 60 === 0 ? `-${back / 60}m` : `-${back}s`;
      ctx.fillText(label, Math.min(Math.max(x(now - back), PAD.left + 10), w - PAD.right - 12), h - PAD.bottom + 5);
    }
    // Stacked areas are filled top series first, so each lower one paints over the one above.
    const order = this.stacked ? [...this.series].reverse() : this.series;
    for (const s of order) {
      ctx.beginPath();
      let open = false;
      this.points.forEach((p, i) => {
        const v = ys[i][s.key];
        if (Number.isNaN(v)) {
          open = false;
          return;
        }
        if (open) ctx.lineTo(x(p.t), y(v));
        else ctx.moveTo(x(p.t), y(v));
        open = true;
      });
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.6;
      if (this.stacked && this.points.length > 1) {
        ctx.lineTo(x(now), y(0));
        ctx.lineTo(x(this.points[0].t), y(0));
        ctx.closePath();
        ctx.fillStyle = `${s.color}cc`;
        ctx.fill();
      } else {
        ctx.stroke();
      }
    }
  }

  drawLegend(values) {
    this.legend.replaceChildren(...this.series.map((s) => {
      const item = document.createElement("span");
      item.className = "item";
      const swatch = document.createElement("i");
      swatch.style.background = s.color;
      const text = document.createElement("span");
      text.textContent = `${s.label} ${formatValue(values[s.key], this.unit)}`;
      item.append(swatch, text);
      return item;
    }));
  }
}

class BarChart {
  constructor(canvas, options) {
    this.canvas = canvas;
    this.unit = options.unit || "";
    this.yMax = options.yMax;
  }

  // bars: [{label, value}]
  draw(bars) {
    const { ctx, w, h } = fitCanvas(this.canvas);
    ctx.clearRect(0, 0, w, h);
    const yMax = this.yMax || Math.max(1e-9, ...bars.map((b) => b.value || 0));
    drawAxes(ctx, w, h, yMax, this.unit);
    const slot = (w - PAD.left - PAD.right) / Math.max(1, bars.length);
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    bars.forEach((b, i) => {
      const v = Number.isNaN(b.value) ? 0 : b.value;
      const bh = (v / yMax) * (h - PAD.top - PAD.bottom);
      const x0 = PAD.left + i * slot + slot * 0.2;
      ctx.fillStyle = PALETTE[0];
      ctx.fillRect(x0, h - PAD.bottom - bh, slot * 0.6, bh);
      ctx.fillStyle = "#8b949e";
      ctx.fillText(b.label, x0 + slot * 0.3, h - PAD.bottom + 5);
    });
  }
}

window.StokerCharts = { LineChart, BarChart, formatValue };
