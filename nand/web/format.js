// Number, time and value formatting shared by every view.

const GROUPED = new Intl.NumberFormat("en-US");

/** 12345 -> "12,345" */
export function count(n) {
  return n === null || n === undefined ? "—" : GROUPED.format(n);
}

/** A measurement in at most 4 significant digits; exponents for the extremes
 * ("3.4e38", "1e-5"): the one format of every chart, axis, heatmap and table. */
export function num(v) {
  if (v === null || v === undefined) return "—";
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e6 || a < 1e-3) {
    const [mantissa, exp] = v.toExponential(2).split("e");
    return `${Number(mantissa)}e${Number(exp)}`; // "1.00e+7" -> "1e7"
  }
  if (a >= 1000) return GROUPED.format(Math.round(v));
  return String(Number(v.toPrecision(4)));
}

/** Seconds since a Unix time, in words: "12 s ago", "3 min ago". */
export function age(unix, now = Date.now() / 1000) {
  if (!unix) return "—";
  const s = Math.max(0, now - unix);
  if (s < 60) return `${Math.floor(s)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

/** A Unix time as a local date and time, "2026-11-22 11:52:03". */
export function datetime(unix) {
  if (!unix) return "—";
  const d = new Date(unix * 1000);
  const p = (n) => String(n).padStart(2, "0");
  return (
    `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
    `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`
  );
}

/** "step 4711" or "step 4711.2" when it happened in a later micro-step. */
export function stepLabel(step, micro) {
  return micro ? `${step}.${micro}` : String(step);
}

/** What the non-finite values were: "+inf", "NaN ×12 and -inf". */
export function valueKinds(e) {
  const parts = [];
  if (e.nan) parts.push(e.nan > 1 ? `NaN ×${count(e.nan)}` : "NaN");
  if (e.posinf) parts.push(e.posinf > 1 ? `+inf ×${count(e.posinf)}` : "+inf");
  if (e.neginf) parts.push(e.neginf > 1 ? `-inf ×${count(e.neginf)}` : "-inf");
  // Activation events carry no counts; the server says in words what min/max showed.
  return parts.length ? parts.join(" and ") : e.values || "a non-finite value";
}

/** "4×1024 float16" */
export function tensorLabel(e) {
  const shape = e.shape && e.shape.length ? e.shape.join("×") : "scalar";
  return e.dtype ? `${shape} ${e.dtype}` : shape;
}

/** "encoder.fc2 (Linear)"; the root module has no name. */
export function where(module, type) {
  const name = module || "the root module";
  return type ? `${name} (${type})` : name;
}

/** Compress a sorted list of ranks: [0,1,2,5] -> "0–2, 5". */
export function rankList(ranks) {
  const out = [];
  let i = 0;
  while (i < ranks.length) {
    let j = i;
    while (j + 1 < ranks.length && ranks[j + 1] === ranks[j] + 1) j++;
    out.push(j > i ? `${ranks[i]}–${ranks[j]}` : String(ranks[i]));
    i = j + 1;
  }
  return out.join(", ");
}
