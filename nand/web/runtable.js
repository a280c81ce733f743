// The runs table: columns, sorting, one row per run.

import { badge } from "./badges.js";
import { el } from "./dom.js";
import { age, count, datetime, where } from "./format.js";

// Diverged runs first, then the ones that need a look, then the quiet ones.
const ATTENTION = { diverged: 0, crashed: 1, stalled: 2, lost: 3, healthy: 4, finished: 5 };

const COLUMNS = [
  { key: "run", label: "Run", value: (r) => r.run },
  { key: "state", label: "State", value: (r) => ATTENTION[r.state] ?? 9 },
  { key: "ranks", label: "Ranks", value: (r) => r.world_size, numeric: true },
  { key: "step", label: "Latest step", value: (r) => r.latest_step, numeric: true },
  { key: "origin", label: "First non-finite", value: (r) => (r.origin ? r.origin.step : Infinity) },
  { key: "events", label: "Events", value: (r) => r.event_count, numeric: true },
  { key: "seen", label: "Last seen", value: (r) => -r.last_seen },
  { key: "started", label: "Started", value: (r) => -r.started_at },
];

/** Sort in place by a column; ties go to the most recently seen run. */
export function sortRuns(list, key, desc) {
  const col = COLUMNS.find((c) => c.key === key) || COLUMNS[1];
  const dir = desc ? -1 : 1;
  return list.sort((a, b) => {
    const x = col.value(a);
    const y = col.value(b);
    const primary = x < y ? -1 : x > y ? 1 : 0;
    return primary * dir || b.last_seen - a.last_seen;
  });
}

function header(sort, desc, onSort) {
  const cells = COLUMNS.map((col) => {
    const active = sort === col.key;
    return el(
      "th",
      {
        scope: "col",
        class: col.numeric ? "num" : "",
        "aria-sort": active ? (desc ? "descending" : "ascending") : "none",
      },
      el(
        "button",
        { type: "button", class: "sort", onclick: () => onSort(col.key, active ? !desc : false) },
        col.label,
        el("span", { class: "sort-mark", "aria-hidden": "true" }, active ? (desc ? "▼" : "▲") : ""),
      ),
    );
  });
  return el("thead", {}, el("tr", {}, cells));
}

function originCell(run) {
  const o = run.origin;
  if (!o) return el("td", { class: "muted" }, "—");
  return el(
    "td",
    { class: "origin-cell" },
    el("span", { class: "mono" }, where(o.module, o.module_type)),
    el("span", { class: "muted block" }, `${o.rank == null ? "ranks together" : `rank ${o.rank}`} · step ${count(o.step)} · ${o.phase}`),
  );
}

function row(run, now, fresh) {
  const ranks =
    run.ranks_seen === run.world_size ? count(run.world_size) : `${run.ranks_seen}/${run.world_size}`;
  return el(
    "tr",
    { class: `row-${run.state}${fresh ? " flash" : ""}`, dataset: { run: run.run } },
    el("th", { scope: "row" }, el("a", { href: `#/runs/${encodeURIComponent(run.run)}` }, run.run)),
    el("td", {}, badge(run.state)),
    el("td", { class: "num", title: `${run.ranks_seen} of ${run.world_size} ranks have reported` }, ranks),
    el("td", { class: "num" }, count(run.latest_step)),
    originCell(run),
    el(
      "td",
      { class: "num" },
      count(run.event_count),
      // A run with gaps says so in the list too: its ranks dropped messages.
      run.messages_dropped
        ? el(
            "span",
            { class: "gaps-mark block", title: "messages its ranks dropped before the server had them" },
            `${count(run.messages_dropped)} dropped`,
          )
        : null,
    ),
    el("td", { title: datetime(run.last_seen) }, age(run.last_seen, now)),
    el("td", { title: datetime(run.started_at) }, age(run.started_at, now)),
  );
}

/** runsTable(runs, {sort, desc, fresh: Set, onSort(key, desc)}) */
export function runsTable(runs, { sort, desc, fresh, onSort }) {
  const now = Date.now() / 1000;
  return el(
    "div",
    { class: "table-wrap" },
    el(
      "table",
      { class: "runs" },
      header(sort, desc, onSort),
      el(
        "tbody",
        {},
        runs.map((r) => row(r, now, fresh.has(r.run))),
      ),
    ),
  );
}
