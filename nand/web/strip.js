// The rank × step health strip: one row per rank, one column per step (or
// per bin of steps when there are more steps than pixels). A rank is healthy
// until its first non-finite step, non-finite after it, and its row ends where
// it stopped reporting. The first non-finite point of each rank is marked, and
// each early warning (a loss spike, a growing gradient norm, a rank whose own
// gradients stand out) is a small triangle on its rank's row.

import { hiDpiCanvas, pointer } from "./canvas.js";
import { cssVar, el } from "./dom.js";
import { count } from "./format.js";
import { linear, niceTicks } from "./scale.js";
import { hideTip, showTip } from "./tooltip.js";

const LABEL_W = 64;
const AXIS_H = 22;
const TOP = 6; // room for the first label

export const RELATION_WORDS = {
  origin: "origin: went non-finite first",
  simultaneous: "went non-finite at the same point as the origin",
  received: "received it through a collective",
  produced: "produced its own, after the origin",
};

/** The step a rank was at when the run started. Its first heartbeat comes a few
 * seconds in (NAND_HEARTBEAT_S), so go back from it at its step rate to the
 * run's start: a run that failed before its first heartbeat then shows its
 * healthy steps first, not a row that is red from its first pixel. A resumed run
 * (first heartbeat at step 47,000) still starts near 47,000, not at 0. */
function startStep(points, startedAt) {
  if (!points.length) return 0;
  const p = points[0];
  const back = startedAt && p.steps_per_s ? Math.max(0, p.time - startedAt) * p.steps_per_s : 0;
  return Math.max(0, Math.floor(p.step - back));
}

/** Per rank: first step, last step, first non-finite step (or null). */
function spans(ranks, series, startedAt) {
  const points = new Map(series.map((s) => [s.rank, s.points]));
  return ranks.map((r) => {
    const bad = r.first_event ? r.first_event.step : null;
    const from = startStep(points.get(r.rank) || [], startedAt);
    return {
      rank: r.rank,
      state: r.state,
      relation: r.relation,
      from: bad === null ? from : Math.min(from, bad),
      to: Math.max(r.step, bad ?? 0),
      bad,
    };
  });
}

function colours() {
  return {
    ok: cssVar("--ok-soft"),
    bad: cssVar("--bad"),
    received: cssVar("--warn"),
    lost: cssVar("--lost"),
    stalled: cssVar("--stall"),
    warned: cssVar("--stall"), // (the charts' triangles: .warn-mark)
    mark: cssVar("--fg"),
    muted: cssVar("--muted"),
    fg: cssVar("--fg"),
  };
}

/** The colour of one bin [s0, s1] of a rank's row, or null for no data. */
function binColour(span, s0, s1, c) {
  if (s1 < span.from) return null;
  if (s0 > span.to) {
    // After its last report: show why it went quiet until the run's end.
    if (span.state === "lost") return c.lost;
    if (span.state === "stalled") return c.stalled;
    return null;
  }
  if (span.bad !== null && s1 >= span.bad) {
    return span.relation === "received" ? c.received : c.bad;
  }
  return c.ok;
}

/** Per row index, the warnings of that row's rank: [{step, kind, message}]. */
function warningsByRow(rows, warnings) {
  const rowOf = new Map(rows.map((r, j) => [r.rank, j]));
  const found = new Map();
  for (const w of warnings) {
    const j = rowOf.get(w.rank);
    if (j === undefined) continue; // a rank on another page of the strip
    if (!found.has(j)) found.set(j, []);
    found.get(j).push(w);
  }
  return found;
}

/** A downward triangle at the top of a row, its tip at the warning's step. */
function drawWarning(ctx, px, y, rowH) {
  const h = Math.max(3, Math.min(7, rowH - 1));
  ctx.beginPath();
  ctx.moveTo(px - h * 0.6, y);
  ctx.lineTo(px + h * 0.6, y);
  ctx.lineTo(px, y + h);
  ctx.closePath();
  ctx.fill();
}

export function healthStrip({ ranks, series, width, onRank, startedAt = null, warnings = [] }) {
  const wrap = el("div", { class: "strip" });
  if (!ranks.length) {
    wrap.append(el("p", { class: "chart-empty" }, "No rank has reported yet."));
    return wrap;
  }
  const rows = spans(ranks, series, startedAt);
  const warned = warningsByRow(rows, warnings);
  const warnedSteps = [...warned.values()].flat().map((w) => w.step);
  const s0 = Math.min(...rows.map((r) => r.from));
  const end = Math.max(s0 + 1, ...rows.map((r) => r.to), ...warnedSteps);
  const plotW = Math.max(120, width - LABEL_W - 8);
  const steps = end - s0 + 1;
  const bins = Math.min(steps, Math.floor(plotW / 2));
  const binW = plotW / bins;
  const per = steps / bins;
  // Rows shrink to fit ~420 px, down to 2 px (1 px past 400 ranks).
  const rowH = Math.max(rows.length > 400 ? 1 : 2, Math.min(16, Math.floor(420 / rows.length)));
  const gap = rowH >= 8 ? 2 : 0;
  const { canvas, ctx } = hiDpiCanvas(
    LABEL_W + plotW,
    TOP + rows.length * rowH + AXIS_H,
    `Health of ${rows.length} ranks over steps ${s0} to ${end}` +
      (warnedSteps.length ? `; early warnings: ${warnedSteps.length}` : ""),
  );
  const c = colours();
  const x = linear(s0, end + 1, LABEL_W, LABEL_W + plotW);

  rows.forEach((span, j) => {
    const y = TOP + j * rowH;
    for (let b = 0; b < bins; b++) {
      const lo = s0 + Math.floor(b * per);
      const hi = s0 + Math.floor((b + 1) * per) - 1;
      const colour = binColour(span, lo, Math.max(lo, hi), c);
      if (!colour) continue;
      ctx.fillStyle = colour;
      ctx.fillRect(LABEL_W + b * binW, y, Math.ceil(binW), rowH - gap);
    }
    if (span.bad !== null) {
      // The first non-finite point: a bar across the row, taller for the origin.
      ctx.fillStyle = c.mark;
      const px = x(span.bad);
      ctx.fillRect(
        px - 1,
        y - (span.relation === "origin" && gap ? 1 : 0),
        3,
        rowH - gap + (span.relation === "origin" && gap ? 2 : 0),
      );
    }
  });
  ctx.fillStyle = c.warned;
  for (const [j, found] of warned) {
    for (const w of found) drawWarning(ctx, x(w.step) + 0.5, TOP + j * rowH, rowH - gap);
  }

  // Rank labels where they fit, else every tenth rank; the origin's always,
  // with its neighbours' labels dropped so they do not overlap it.
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const labelEvery = rowH >= 11 ? 1 : Math.ceil(13 / rowH / 10) * 10;
  const originRow = rows.findIndex((r) => r.relation === "origin");
  rows.forEach((span, j) => {
    const isOrigin = j === originRow;
    if (!isOrigin && (j % labelEvery || (originRow >= 0 && Math.abs(j - originRow) * rowH < 13))) return;
    ctx.fillStyle = isOrigin ? c.fg : c.muted;
    ctx.font = isOrigin ? "bold 11px system-ui, sans-serif" : "11px system-ui, sans-serif";
    ctx.fillText(`rank ${span.rank}`, LABEL_W - 8, TOP + j * rowH + (rowH - gap) / 2);
  });
  ctx.font = "11px system-ui, sans-serif";
  ctx.textAlign = "center";
  ctx.fillStyle = c.muted;
  for (const t of niceTicks(s0, end, 8)) {
    if (Number.isInteger(t)) ctx.fillText(count(t), x(t), TOP + rows.length * rowH + 12);
  }

  canvas.addEventListener("mousemove", (ev) => {
    const p = pointer(canvas, ev);
    const j = Math.floor((p.y - TOP) / rowH);
    if (p.x < LABEL_W || j < 0 || j >= rows.length) return hideTip();
    const span = rows[j];
    const step = Math.floor(x.invert(p.x));
    let state = "finite";
    if (step < span.from || step > span.to)
      state = span.state === "lost" || span.state === "stalled" ? span.state : "no report";
    else if (span.bad !== null && step >= span.bad) state = "non-finite";
    const lines = [
      `rank ${span.rank} · step ${count(step)}`,
      ["state here", state],
      ["rank now", span.state],
    ];
    if (span.bad !== null) lines.push(["first non-finite", `step ${count(span.bad)}`]);
    if (span.relation) lines.push(RELATION_WORDS[span.relation]);
    // The warnings within 4 px of the pointer on this row.
    const near = Math.abs(x.invert(p.x + 4) - x.invert(p.x));
    for (const w of warned.get(j) || []) {
      if (Math.abs(w.step - step) <= near) lines.push(`warning at step ${count(w.step)}: ${w.message}`);
    }
    showTip(lines, ev.clientX, ev.clientY);
  });
  canvas.addEventListener("mouseleave", hideTip);
  canvas.addEventListener("click", (ev) => {
    const j = Math.floor((pointer(canvas, ev).y - TOP) / rowH);
    if (onRank && j >= 0 && j < rows.length) onRank(rows[j].rank);
  });

  wrap.append(
    el("div", { class: "strip-scroll" }, canvas),
    el(
      "ul",
      { class: "legend" },
      el("li", {}, el("span", { class: "swatch ok" }), "finite"),
      // Only the colours this strip uses.
      rows.some((r) => r.bad !== null && r.relation !== "received")
        ? el("li", {}, el("span", { class: "swatch bad" }), "non-finite (origin or produced)")
        : null,
      rows.some((r) => r.relation === "received")
        ? el("li", {}, el("span", { class: "swatch received" }), "non-finite, received")
        : null,
      rows.some((r) => r.bad !== null)
        ? el("li", {}, el("span", { class: "swatch mark" }), "first non-finite step")
        : null,
      warnedSteps.length
        ? el("li", {}, el("span", { class: "swatch warned" }), "early warning (hover it)")
        : null,
      rows.some((r) => r.state === "lost")
        ? el("li", {}, el("span", { class: "swatch lost" }), "lost")
        : null,
      rows.some((r) => r.state === "stalled")
        ? el("li", {}, el("span", { class: "swatch stalled" }), "stalled")
        : null,
    ),
  );
  return wrap;
}
