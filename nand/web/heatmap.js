// The flight-recorder heatmap: layer × step of max |x| on a log colour scale,
// leading into the incident. The top of the scale is the dtype's largest
// finite value, so a layer creeping towards overflow turns yellow before it
// goes non-finite.

import { fitLabel, hiDpiCanvas, pointer } from "./canvas.js";
import { cssVar, el, svg } from "./dom.js";
import { count, num } from "./format.js";
import { colormap, COLORMAP_CSS, linear, logTicks } from "./scale.js";
import { hideTip, showTip } from "./tooltip.js";

const AXIS = 22;
const REACH = 1e4; // the dtype limit is on the scale when max |x| is within this factor

/** The colour scale. The server gives the run's range over every rank's window
 * and both views (scale_min/scale_max), so one colour means one magnitude
 * whichever rank or view is shown; a window without it uses its own values. */
function magnitudeRange(flight, matrix) {
  const dtypeMax = flight.dtype_max;
  let lo = flight.scale_min ?? Infinity;
  let hi = flight.scale_max ?? 0;
  if (flight.scale_min == null) {
    for (const row of matrix) {
      for (const v of row) {
        if (v === null || v <= 0) continue;
        lo = Math.min(lo, v);
        hi = Math.max(hi, v);
      }
    }
  }
  if (!Number.isFinite(lo)) return null;
  // The scale ends at the dtype's limit when the values come within reach
  // of it (float16: 65504), so the build-up shows; for float32/bfloat16
  // (3.4e38) the limit is far away and would squash every colour together.
  const reach = dtypeMax && hi * REACH >= dtypeMax;
  const top = reach ? Math.log10(dtypeMax) : Math.max(Math.ceil(Math.log10(hi)), Math.log10(hi));
  const bottom = Math.min(Math.floor(Math.log10(lo)), top - 1);
  return { lo: bottom, hi: Math.max(top, Math.log10(hi)), limitShown: Boolean(reach) };
}

/** The colour bar with power-of-ten ticks and the dtype limit marked. */
function colourBar(range, flight) {
  const width = 320;
  const x = linear(range.lo, range.hi, 0, width);
  const ticks = svg("svg", {
    class: "bar-ticks",
    viewBox: `0 0 ${width} 30`,
    width,
    height: 30,
    "aria-hidden": "true",
  });
  for (const e of logTicks(range.lo, range.hi, 7)) {
    ticks.append(
      svg("line", { x1: x(e), x2: x(e), y1: 0, y2: 5 }),
      svg(
        "text",
        { x: x(e), y: 17, "text-anchor": e === range.lo ? "start" : "middle" },
        num(10 ** e),
      ),
    );
  }
  const bar = el("div", { class: "bar" });
  bar.style.background = COLORMAP_CSS;
  const parts = [el("span", { class: "bar-label" }, "max |x|"), el("div", { class: "bar-wrap" }, bar, ticks)];
  if (flight.dtype_max && !range.limitShown) {
    parts.push(
      el(
        "span",
        { class: "limit-label" },
        `${flight.dtype || "dtype"} limit ${num(flight.dtype_max)}: far above these values`,
      ),
    );
  } else if (flight.dtype_max) {
    const px = x(Math.log10(flight.dtype_max));
    ticks.append(svg("line", { class: "limit", x1: px - 1, x2: px - 1, y1: 0, y2: 8 }));
    parts.push(
      el(
        "span",
        { class: "limit-label" },
        el("span", { class: "limit-swatch" }),
        `${flight.dtype || "dtype"} limit ${num(flight.dtype_max)}`,
      ),
    );
  }
  parts.push(
    el("span", { class: "none-label" }, el("span", { class: "nonfinite-swatch" }), "non-finite (NaN/inf)"),
    el("span", { class: "none-label" }, el("span", { class: "none-swatch" }), "not recorded"),
  );
  return el("div", { class: "colour-legend" }, parts);
}

/** The layer that came closest to the dtype limit, in words. */
function closest(flight, matrix, range) {
  if (!flight.dtype_max || !range.limitShown) return null;
  let best = null;
  matrix.forEach((row, i) =>
    row.forEach((v, j) => {
      if (v !== null && (!best || v > best.v)) best = { v, step: flight.steps[i], module: flight.modules[j] };
    }),
  );
  if (!best) return null;
  const share = (100 * best.v) / flight.dtype_max;
  return el(
    "p",
    { class: "muted closest" },
    "Closest to the limit: ",
    el("code", {}, best.module || "(root)"),
    ` reached ${num(best.v)} at step ${count(best.step)}, ${share >= 10 ? Math.round(share) : share.toPrecision(2)}% of the ${flight.dtype || "dtype"} maximum.`,
  );
}

function draw(flight, matrix, bad, range, origin, width) {
  const rows = flight.modules.length;
  const cols = flight.steps.length;
  // Rows shrink to fit ~520 px, down to 2 px (1 px past 260 layers); the
  // tooltip names the layer when the labels no longer fit.
  const rowH = Math.max(rows > 260 ? 1 : 2, Math.min(18, Math.floor(520 / rows)));
  const probe = hiDpiCanvas(1, 1, "").ctx;
  probe.font = "12px ui-monospace, SFMono-Regular, Menlo, monospace";
  const labels = rowH >= 9;
  const labelW = labels
    ? Math.min(
        240,
        Math.ceil(Math.max(...flight.modules.map((m) => probe.measureText(m || "(root)").width))) + 12,
      )
    : 12;
  const cellW = Math.max(2, Math.min(44, Math.floor((width - labelW) / cols)));
  const plotW = cellW * cols;
  const height = rowH * rows + AXIS;
  const { canvas, ctx } = hiDpiCanvas(
    labelW + plotW,
    height,
    `Heatmap of max |x| for ${rows} layers over ${cols} steps`,
  );
  const fg = cssVar("--fg");
  const muted = cssVar("--muted");
  const none = cssVar("--none");
  const nonfinite = cssVar("--nonfinite");
  const scale = linear(range.lo, range.hi, 0, 1);
  const colour = (v) => `rgb(${colormap(scale(Math.log10(Math.min(Math.max(v, 10 ** range.lo), 10 ** range.hi)))).join(",")})`;

  for (let i = 0; i < cols; i++) {
    for (let j = 0; j < rows; j++) {
      const v = matrix[i][j];
      ctx.fillStyle = bad.has(`${i},${j}`) ? nonfinite : v === null ? none : colour(v);
      ctx.fillRect(labelW + i * cellW, j * rowH, cellW - (cellW > 4 ? 1 : 0), rowH - (rowH > 4 ? 1 : 0));
    }
  }
  ctx.font = "12px ui-monospace, SFMono-Regular, Menlo, monospace";
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  if (labels) {
    flight.modules.forEach((m, j) => {
      ctx.fillStyle = origin && m === origin.module ? fg : muted;
      ctx.fillText(fitLabel(ctx, m || "(root)", labelW - 12), labelW - 6, j * rowH + rowH / 2);
    });
  }
  // Step axis: a label every ~60 px.
  ctx.textAlign = "center";
  ctx.fillStyle = muted;
  ctx.font = "11px system-ui, sans-serif";
  const every = Math.max(1, Math.ceil(60 / cellW));
  for (let i = 0; i < cols; i += every)
    ctx.fillText(count(flight.steps[i]), labelW + i * cellW + cellW / 2, rows * rowH + 12);

  // Ring the origin cell: where the build-up ended.
  const oi = origin ? flight.steps.indexOf(origin.step) : -1;
  const oj = origin ? flight.modules.indexOf(origin.module) : -1;
  if (oi >= 0 && oj >= 0) {
    ctx.strokeStyle = cssVar("--bad");
    ctx.lineWidth = 2;
    ctx.strokeRect(labelW + oi * cellW - 1, oj * rowH - 1, cellW + 1, rowH + 1);
  }

  canvas.addEventListener("mousemove", (ev) => {
    const p = pointer(canvas, ev);
    const i = Math.floor((p.x - labelW) / cellW);
    const j = Math.floor(p.y / rowH);
    if (i < 0 || i >= cols || j < 0 || j >= rows) return hideTip();
    const v = matrix[i][j];
    const lines = [
      flight.modules[j] || "(root module)",
      ["step", count(flight.steps[i])],
      ["max |x|", bad.has(`${i},${j}`) ? "non-finite (NaN/inf)" : v === null ? "not recorded" : num(v)],
    ];
    if (v !== null && flight.dtype_max && range.limitShown)
      lines.push([`of ${flight.dtype || "dtype"} max`, `${((100 * v) / flight.dtype_max).toPrecision(2)}%`]);
    if (i === oi && j === oj) lines.push("first non-finite value here");
    showTip(lines, ev.clientX, ev.clientY);
  });
  canvas.addEventListener("mouseleave", hideTip);
  return canvas;
}

/**
 * heatmap(flight, origin, width) -> element. `which` picks the matrix:
 * "act" (layer outputs) or "grad" (gradients flowing out of each layer).
 */
export function heatmap(flight, origin, width, which = "act") {
  const matrix = which === "grad" ? flight.grad_max_abs : flight.act_max_abs;
  const wrap = el("div", { class: "heatmap" });
  if (!flight.steps.length || !flight.modules.length || !matrix.length) {
    wrap.append(el("p", { class: "chart-empty" }, "This window holds no per-layer values."));
    return wrap;
  }
  const range = magnitudeRange(flight, matrix);
  const bad = new Set(((which === "grad" ? flight.grad_nonfinite : flight.act_nonfinite) || []).map(([i, j]) => `${i},${j}`));
  if (!range) {
    wrap.append(el("p", { class: "chart-empty" }, "No finite value in this window."));
    return wrap;
  }
  wrap.append(
    el(
      "div",
      { class: "heatmap-scroll" },
      draw(flight, matrix, bad, range, origin && (origin.rank ?? origin.ranks[0]) === flight.rank ? origin : null, width),
    ),
    colourBar(range, flight),
  );
  const note = closest(flight, matrix, range);
  if (note) wrap.append(note);
  return wrap;
}
