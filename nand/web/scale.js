// Scales and tick marks for the charts, the strip and the heatmap.

/** "Nice" tick values (1, 2, 5 × 10^k) covering [lo, hi], about `n` of them. */
export function niceTicks(lo, hi, n = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / n;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const steps = [0.5, 1, 2, 5, 10].map((m) => m * mag);
  // The largest step under `raw` (with slack for rounding), but never fewer than 3 ticks.
  let i = steps.findIndex((s) => raw <= s * 1.001);
  let ticks = [];
  for (; i >= 0; i--) {
    ticks = [];
    for (let t = Math.ceil(lo / steps[i]) * steps[i]; t <= hi + steps[i] * 1e-9; t += steps[i]) {
      ticks.push(Number(t.toPrecision(12)));
    }
    if (ticks.length >= 3) break;
  }
  return ticks;
}

/** Powers of ten between two log10 values, thinned to at most `n`. */
export function logTicks(lo, hi, n = 6) {
  const first = Math.ceil(lo);
  const last = Math.floor(hi);
  const every = Math.max(1, Math.ceil((last - first + 1) / n));
  const ticks = [];
  for (let e = first; e <= last; e += every) ticks.push(e);
  return ticks;
}

/** Tick values for a log axis over [lo, hi] (values, not exponents): powers
 * of ten, with 2 and 5 in between when the range spans under two decades. */
export function logValueTicks(lo, hi, n = 5) {
  const a = Math.log10(lo);
  const b = Math.log10(hi);
  if (b - a >= 2) return logTicks(a, b, n).map((e) => 10 ** e);
  const ticks = [];
  for (let e = Math.floor(a); e <= Math.ceil(b); e++) {
    for (const m of [1, 2, 5]) {
      const v = m * 10 ** e;
      if (v >= lo && v <= hi) ticks.push(Number(v.toPrecision(6)));
    }
  }
  return ticks;
}

/** A linear map from [d0, d1] to [r0, r1]. */
export function linear(d0, d1, r0, r1) {
  const k = d1 === d0 ? 0 : (r1 - r0) / (d1 - d0);
  const f = (v) => r0 + (v - d0) * k;
  f.invert = (p) => (k === 0 ? d0 : d0 + (p - r0) / k);
  return f;
}

/** Index of the item whose key is nearest to x, in an array sorted by key. */
export function nearest(items, x, key) {
  let lo = 0;
  let hi = items.length - 1;
  if (hi < 0) return -1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (key(items[mid]) < x) lo = mid + 1;
    else hi = mid;
  }
  if (lo > 0 && Math.abs(key(items[lo - 1]) - x) <= Math.abs(key(items[lo]) - x)) return lo - 1;
  return lo;
}

// A perceptual sequential colour map (viridis-like): dark blue-violet for
// small magnitudes through teal to yellow at the top of the scale. Readable
// on the light and the dark background alike.
const STOPS = [
  [68, 1, 84],
  [59, 82, 139],
  [33, 145, 140],
  [94, 201, 98],
  [253, 231, 37],
];

/** t in [0, 1] -> [r, g, b] */
export function colormap(t) {
  const x = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x));
  const f = x - i;
  return STOPS[i].map((c, k) => Math.round(c + (STOPS[i + 1][k] - c) * f));
}

export const COLORMAP_CSS = `linear-gradient(to right, ${STOPS.map((s) => `rgb(${s.join(",")})`).join(", ")})`;
