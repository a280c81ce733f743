// Small SVG line charts: one line per rank, axes, a legend and hover values.
// Many ranks (a 256-GPU job) are drawn as a faint band with the origin rank
// on top, because 256 distinct colours are unreadable.

import { el, svg } from "./dom.js";
import { count, num, rankList } from "./format.js";
import { linear, logValueTicks, nearest, niceTicks } from "./scale.js";
import { hideTip, showTip } from "./tooltip.js";

const W = 560;
const H = 210;
const PAD = { left: 58, right: 14, top: 22, bottom: 32 };
const DISTINCT = 10; // up to this many ranks get a colour each

/** Keep the shape of a long line: per pixel column, the first, min and max points. */
function thin(points, x, y) {
  if (points.length <= 2 * (W - PAD.left)) return points;
  const out = [];
  let col = null;
  let lo = null;
  let hi = null;
  const flush = () => {
    if (lo) out.push(...(lo.step <= hi.step ? [lo, hi] : [hi, lo]));
  };
  for (const p of points) {
    const c = Math.round(x(p.step));
    if (c !== col || p.value === null) {
      flush();
      col = c;
      lo = hi = null;
      if (p.value === null) {
        out.push(p);
        continue;
      }
    }
    if (!lo || y(p.value) > y(lo.value)) lo = p;
    if (!hi || y(p.value) < y(hi.value)) hi = p;
  }
  flush();
  return out;
}

/** SVG path data; a null value breaks the line (the value was non-finite or
 * unknown). A point with no neighbour draws no line, so it comes back in `dots`:
 * a run with one heartbeat still shows its one value. */
function pathData(points, x, y) {
  let d = "";
  const dots = [];
  let run = [];
  const flush = () => {
    if (run.length === 1) dots.push(run[0]);
    run = [];
  };
  for (const p of points) {
    if (p.value === null) {
      flush();
      continue;
    }
    d += `${run.length ? "L" : "M"}${x(p.step).toFixed(1)},${y(p.value).toFixed(1)}`;
    run.push(p);
  }
  flush();
  return { d, dots };
}

const DASH = 6;

/** Ranks whose lines are identical (after DDP's all-reduce every rank has the same
 * gradient norm): rank -> {index, size}. Such lines are drawn in stripes, each
 * rank's colour in turn, so none hides the others. */
function identicalGroups(lines) {
  const byKey = new Map();
  for (const line of lines) {
    const key = JSON.stringify(line.points.map((p) => [p.step, p.value]));
    if (!byKey.has(key)) byKey.set(key, []);
    byKey.get(key).push(line.rank);
  }
  const groups = new Map();
  for (const ranks of byKey.values())
    ranks.forEach((rank, index) => groups.set(rank, { index, size: ranks.length, ranks }));
  return groups;
}

function stripes(group) {
  if (!group || group.size < 2) return {};
  return {
    "stroke-dasharray": `${DASH} ${DASH * (group.size - 1)}`,
    "stroke-dashoffset": String(-DASH * group.index),
  };
}

/** Value and step ranges; the step range includes `mark` (the first non-finite
 * step), so its dashed line shows even when the heartbeats stopped before it. */
function extent(lines, log, mark = null) {
  let lo = Infinity;
  let hi = -Infinity;
  let s0 = mark ?? Infinity;
  let s1 = mark ?? -Infinity;
  for (const line of lines) {
    for (const p of line.points) {
      s0 = Math.min(s0, p.step);
      s1 = Math.max(s1, p.step);
      if (p.value === null || (log && p.value <= 0)) continue;
      lo = Math.min(lo, p.value);
      hi = Math.max(hi, p.value);
    }
  }
  return { lo, hi, s0, s1 };
}

function axes(x, y, ext, log) {
  const g = svg("g", { class: "axis" });
  const yTicks = log ? logValueTicks(ext.lo, ext.hi, 5) : niceTicks(ext.lo, ext.hi, 4);
  for (const t of yTicks) {
    const py = y(t);
    if (py < PAD.top - 1 || py > H - PAD.bottom + 1) continue;
    g.append(
      svg("line", { class: "grid", x1: PAD.left, x2: W - PAD.right, y1: py, y2: py }),
      svg("text", { x: PAD.left - 6, y: py + 4, "text-anchor": "end" }, num(t)),
    );
  }
  for (const t of niceTicks(ext.s0, ext.s1, 6)) {
    if (!Number.isInteger(t)) continue;
    const px = x(t);
    g.append(
      svg("line", { class: "tick", x1: px, x2: px, y1: H - PAD.bottom, y2: H - PAD.bottom + 4 }),
      svg("text", { x: px, y: H - PAD.bottom + 16, "text-anchor": "middle" }, count(t)),
    );
  }
  g.append(
    svg("line", { class: "frame", x1: PAD.left, x2: W - PAD.right, y1: H - PAD.bottom, y2: H - PAD.bottom }),
    svg("text", { class: "axis-label", x: W - PAD.right, y: H - 2, "text-anchor": "end" }, "step"),
  );
  return g;
}

function legend(lines, origin, groups) {
  if (lines.length <= DISTINCT) {
    const same = [...new Set([...groups.values()].filter((g) => g.size > 1).map((g) => g.ranks))];
    return el(
      "ul",
      { class: "legend" },
      lines.map((line) =>
        el(
          "li",
          {},
          // The origin is red, never a palette colour (one of them is the "finite" green).
          el("span", { class: line.rank === origin ? "swatch origin" : `swatch c${line.rank % DISTINCT}` }),
          `rank ${line.rank}`,
          line.rank === origin ? el("span", { class: "muted" }, " (origin)") : null,
        ),
      ),
      same.map((ranks) => el("li", { class: "muted legend-note" }, `ranks ${rankList(ranks)}: the same values (striped line)`)),
    );
  }
  return el(
    "ul",
    { class: "legend" },
    origin !== null && origin !== undefined
      ? el("li", {}, el("span", { class: "swatch origin" }), `rank ${origin} (origin)`)
      : null,
    el(
      "li",
      {},
      el("span", { class: "swatch band" }),
      `${lines.length - (origin == null ? 0 : 1)} other ranks`,
    ),
  );
}

/** The values under the cursor: per rank, the point nearest to `step`, if close. */
function hoverLines(lines, step, tolerance, origin) {
  const rows = [];
  let at = null;
  for (const line of lines) {
    const i = nearest(line.points, step, (p) => p.step);
    if (i < 0 || Math.abs(line.points[i].step - step) > tolerance) continue;
    const p = line.points[i];
    rows.push([line.rank, p.value]);
    if (at === null || line.rank === origin) at = p.step;
  }
  rows.sort((a, b) => (a[0] === origin ? -1 : b[0] === origin ? 1 : a[0] - b[0]));
  const shown = rows
    .slice(0, 8)
    .map(([rank, v]) => [
      `rank ${rank}${rank === origin ? " (origin)" : ""}`,
      v === null ? "not finite" : num(v),
    ]);
  if (rows.length > 8) shown.push(`… and ${rows.length - 8} more ranks`);
  return { at, rows: shown };
}

/**
 * lineChart({title, lines: [{rank, points: [{step, value}]}], origin, mark, warnings, log})
 * `mark` is the step of the first non-finite value (a dashed line); `warnings`
 * the run's early warnings ({step, rank, kind, message}), a triangle each.
 */
export function lineChart({ title, lines, origin = null, mark = null, warnings = [], log = false }) {
  const figure = el("figure", { class: "chart" }, el("figcaption", {}, title));
  let ext = extent(lines, log, mark);
  if (!Number.isFinite(ext.lo)) {
    figure.append(el("p", { class: "chart-empty" }, "No values reported yet."));
    return figure;
  }
  if (log && ext.hi / ext.lo < 10) log = false;
  if (!log) ext = extent(lines, false, mark);
  if (ext.hi === ext.lo) {
    ext.hi += Math.abs(ext.hi) * 0.1 || 1;
    ext.lo -= Math.abs(ext.lo) * 0.1 || 1;
  }
  if (ext.s1 === ext.s0) ext.s1 += 1;
  // A little headroom, so the extremes do not sit on the frame.
  if (log) {
    ext.lo /= 1.15;
    ext.hi *= 1.15;
  } else {
    const pad = (ext.hi - ext.lo) * 0.06;
    ext.hi += pad;
    ext.lo = ext.lo >= 0 && ext.lo - pad < 0 ? 0 : ext.lo - pad;
  }
  const x = linear(ext.s0, ext.s1, PAD.left, W - PAD.right);
  const ly = linear(
    log ? Math.log10(ext.lo) : ext.lo,
    log ? Math.log10(ext.hi) : ext.hi,
    H - PAD.bottom,
    PAD.top,
  );
  const y = log ? (v) => ly(Math.log10(v)) : ly;
  const safe = log ? (p) => (p.value !== null && p.value <= 0 ? { ...p, value: null } : p) : (p) => p;

  const plot = svg("g", { class: "lines" });
  const many = lines.length > DISTINCT;
  const groups = identicalGroups(lines);
  // The origin rank is drawn last so it stays on top.
  const ordered = [...lines].sort((a, b) => (a.rank === origin) - (b.rank === origin));
  for (const line of ordered) {
    const { d, dots } = pathData(thin(line.points.map(safe), x, y), x, y);
    const cls = line.rank === origin ? "line origin" : many ? "line band" : `line c${line.rank % DISTINCT}`;
    const attrs = many ? {} : stripes(groups.get(line.rank));
    if (d) plot.append(svg("path", { class: cls, d, ...attrs, dataset: { rank: line.rank } }));
    for (const p of dots)
      plot.append(svg("circle", { class: `dot ${cls}`, cx: x(p.step), cy: y(p.value), r: 1.6, dataset: { rank: line.rank } }));
  }
  const chart = svg(
    "svg",
    { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${title} per rank over steps` },
    axes(x, y, ext, log),
    plot,
  );
  if (mark !== null && mark >= ext.s0 && mark <= ext.s1) {
    chart.append(
      svg("line", { class: "mark", x1: x(mark), x2: x(mark), y1: PAD.top, y2: H - PAD.bottom }),
      // Above the plot area, so it never sits on top of a line.
      svg(
        "text",
        { class: "mark-label", x: x(mark) + 3, y: PAD.top - 8, "text-anchor": "end" },
        "first non-finite",
      ),
    );
  }
  for (const w of warnings) {
    if (w.step < ext.s0 || w.step > ext.s1) continue;
    const cx = x(w.step);
    chart.append(
      svg(
        "path",
        { class: `warn-mark warn-${w.kind}`, d: `M${cx - 4},${PAD.top - 7}h8l-4,6z`, dataset: { step: w.step } },
        svg("title", {}, `rank ${w.rank}: ${w.message}`),
      ),
    );
  }
  const cursor = svg("line", { class: "cursor", y1: PAD.top, y2: H - PAD.bottom, visibility: "hidden" });
  chart.append(cursor);
  chart.addEventListener("mousemove", (ev) => {
    const box = chart.getBoundingClientRect();
    const px = ((ev.clientX - box.left) / box.width) * W;
    if (px < PAD.left || px > W - PAD.right) return hideTip();
    // Within 8 SVG units of the cursor counts as "under" it.
    const tolerance = Math.abs(x.invert(px + 8) - x.invert(px));
    const { at, rows } = hoverLines(lines, x.invert(px), tolerance, origin);
    if (!rows.length) return hideTip();
    cursor.setAttribute("x1", x(at));
    cursor.setAttribute("x2", x(at));
    cursor.setAttribute("visibility", "visible");
    showTip([`${title} · step ${count(at)}`, ...rows], ev.clientX, ev.clientY);
  });
  chart.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    hideTip();
  });
  figure.append(chart, legend(lines, origin, groups));
  if (log) figure.querySelector("figcaption").append(el("span", { class: "muted" }, " · log scale"));
  return figure;
}
