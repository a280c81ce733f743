// The run page: the verdict first, then the evidence: the rank × step strip,
// the flight-recorder heatmap, the training curves and the event table.

import { api, onRunChange } from "./api.js";
import { badge } from "./badges.js";
import { lineChart } from "./charts.js";
import { clear, el, innerWidth, panel, stateMessage } from "./dom.js";
import { eventTable } from "./events.js";
import { age, count, datetime } from "./format.js";
import { flightPanel } from "./flight.js";
import { gapsPanel } from "./gaps.js";
import { stopButton } from "./stop.js";
import { healthStrip } from "./strip.js";
import { verdictCard } from "./verdict.js";

const RANK_PAGE = 1000; // ranks in the strip at a time

const CURVES = [
  { key: "loss", title: "Loss", log: false },
  { key: "grad_norm", title: "Gradient norm", log: true },
  { key: "steps_per_s", title: "Steps per second", log: false },
  { key: "max_activation", title: "Largest activation |x|", log: true },
];

function header(run) {
  const bits = [
    `${count(run.world_size)} ${run.world_size === 1 ? "rank" : "ranks"}`,
    `step ${count(run.latest_step)}`,
    `${count(run.event_count)} ${run.event_count === 1 ? "event" : "events"}`,
    `started ${datetime(run.started_at)}`,
    `last seen ${age(run.last_seen)}`,
  ];
  if (run.ranks_seen !== run.world_size) bits.splice(1, 0, `${run.ranks_seen} reported`);
  // A run id used again (a re-applied Job) is a new attempt; the page shows the live one.
  const attempts = run.attempts || [];
  if (attempts.length > 1) bits.unshift(`attempt ${count(run.attempt)} of ${count(attempts.length)}`);
  if (run.optimizer) bits.push(run.optimizer);
  const versions = Object.entries(run.versions || {})
    .map(([k, v]) => `${k} ${v}`)
    .join(" · ");
  return el(
    "div",
    {},
    el("nav", { class: "crumbs", "aria-label": "Breadcrumb" }, el("a", { href: "#/" }, "Runs"), " / "),
    el("h1", {}, el("span", { class: "run-id" }, run.run), " ", badge(run.state)),
    el("p", { class: "meta", title: versions }, bits.join(" · ")),
  );
}

function curves(series, origin, warnings = []) {
  const grid = el("div", { class: "charts" });
  for (const c of CURVES) {
    const lines = series.map((s) => ({
      rank: s.rank,
      points: s.points.map((p) => ({ step: p.step, value: p[c.key] ?? null })),
    }));
    grid.append(
      lineChart({
        title: c.title,
        lines,
        origin: origin ? origin.rank : null,
        mark: origin ? origin.step : null,
        warnings,
        log: c.log,
      }),
    );
  }
  return grid;
}

/** "ranks 0–999 of 20,000 (19,990 diverged, 10 running)" with Previous / Next,
 * for a run with more ranks than one page; nothing for a run that fits. */
function rankPager(page, after, { onPrevious, onNext }) {
  if (after === null && page.next_after === null) return null;
  const items = page.items;
  const span = items.length ? `${count(items[0].rank)}–${count(items[items.length - 1].rank)}` : "none";
  const states = Object.entries(page.states)
    .sort((a, b) => b[1] - a[1])
    .map(([state, n]) => `${count(n)} ${state}`)
    .join(", ");
  return el(
    "div",
    { class: "pager rank-pager" },
    el("button", { type: "button", disabled: after === null, onclick: onPrevious }, "← Previous ranks"),
    el("span", { class: "page-status" }, `ranks ${span} of ${count(page.total)}`, states ? ` (${states})` : ""),
    el("button", { type: "button", disabled: page.next_after === null, onclick: onNext }, "Next ranks →"),
  );
}

export function runPage(main, runId, params) {
  document.title = `${runId} · nand`;
  main.append(stateMessage("loading", `Loading run ${runId}…`));
  let alive = true;
  let parts = null;
  // The strip shows one page of ranks (a 20,000-rank run is a page at a time):
  // the page's `after`, and the `after`s of the pages before it for Previous.
  let rankAfter = null;
  const earlier = [];

  const rankPage = () => api.ranks(runId, { limit: RANK_PAGE, after: rankAfter });

  async function fetchAll() {
    const [detail, page, series, warnings] = await Promise.all([
      api.run(runId), rankPage(), api.series(runId), api.warnings(runId),
    ]);
    return { detail, ranks: page.items, page, series, warnings };
  }

  async function turnRanks(after, back) {
    const before = rankAfter;
    rankAfter = after;
    try {
      const page = await rankPage();
      if (!alive || !parts) return;
      if (back) earlier.pop();
      else earlier.push(before);
      parts.ranks = page.items;
      parts.page = page;
      drawVisuals();
    } catch {
      rankAfter = before; // keep the page shown
    }
  }

  function mount({ detail, ranks, page, series, warnings }) {
    const started = performance.now();
    clear(main);
    const origin = detail.verdict.origin;
    const stop = stopButton(detail, refresh);
    const slots = {
      head: el("div", {}, header(detail)),
      verdict: el("div", {}, verdictCard(detail.verdict, detail)),
      gaps: el("div", {}, gapsPanel(detail)),
      pager: el("div", {}),
      strip: el("div", {}),
      curves: el("div", {}),
    };
    const events = el("div", { class: "events-root" });
    main.append(
      el("div", { class: "page-head run-head" }, slots.head, stop.node),
      slots.verdict,
      slots.gaps,
      panel(
        "ranks",
        "Ranks over time",
        "Each row is a rank; the bar marks its first non-finite step. Click a row to list its events.",
        slots.pager,
        slots.strip,
      ),
    );
    const flight = flightPanel(runId, ranks, origin);
    main.append(
      flight.node,
      panel(
        "training",
        "Training",
        "Per rank, from the heartbeats; the dashed line is the first non-finite step, a triangle an early warning (hover it).",
        slots.curves,
      ),
      panel("events", "Events", "Every non-finite value seen, in logical order.", events),
    );
    const table = eventTable(events, {
      run: runId,
      ranks,
      allRanks: page.next_after === null,
      modules: detail.modules,
      originId: origin ? origin.event_id : null,
      params,
    });
    parts = { slots, stop, flight, table, detail, ranks, page, series, warnings };
    drawVisuals();
    main.dataset.renderMs = (performance.now() - started).toFixed(1);
  }

  function drawVisuals() {
    const { slots, ranks, page, series, detail, warnings } = parts;
    const origin = detail.verdict.origin;
    clear(slots.pager).append(
      rankPager(page, rankAfter, {
        onPrevious: () => turnRanks(earlier[earlier.length - 1] ?? null, true),
        onNext: () => turnRanks(page.next_after, false),
      }) || "",
    );
    const strip = healthStrip({
      ranks,
      series,
      startedAt: detail.started_at,
      warnings,
      width: innerWidth(slots.strip),
      onRank: (rank) => {
        parts.table.setRank(rank);
        document.getElementById("events").scrollIntoView({ behavior: "smooth" });
      },
    });
    clear(slots.strip).append(strip);
    clear(slots.curves).append(curves(series, origin, warnings));
  }

  // Live refresh: one at a time, then a pause of at least 2 s or five times
  // what the last one cost (a 256-rank run's series is megabytes), so a busy
  // run keeps neither the browser nor the server busy. A change that comes
  // during the pause is fetched after it.
  let busy = false;
  let again = false;
  async function refresh() {
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    const started = performance.now();
    try {
      const next = await fetchAll();
      if (!alive || !parts) return;
      const before = parts.detail;
      parts.detail = next.detail;
      parts.ranks = next.ranks;
      parts.page = next.page;
      parts.series = next.series;
      parts.warnings = next.warnings;
      clear(parts.slots.head).append(header(next.detail));
      parts.stop.sync(next.detail);
      clear(parts.slots.verdict).append(verdictCard(next.detail.verdict, next.detail));
      clear(parts.slots.gaps).append(el("div", {}, gapsPanel(next.detail)));
      drawVisuals();
      if (next.detail.event_count !== before.event_count) parts.table.changed();
      if (!before.verdict.origin && next.detail.verdict.origin) {
        // It just went non-finite: the flight window is new evidence.
        const flight = flightPanel(runId, next.ranks, next.detail.verdict.origin);
        parts.flight.node.replaceWith(flight.node);
        parts.flight = flight;
      }
    } catch {
      /* the live view keeps what it has; the stream status shows the outage */
    }
    setTimeout(
      () => {
        busy = false;
        if (again && alive) {
          again = false;
          refresh();
        }
      },
      Math.max(2000, 5 * (performance.now() - started)),
    );
  }

  async function load() {
    try {
      const data = await fetchAll();
      if (alive) mount(data);
    } catch (err) {
      if (!alive) return;
      clear(main).append(
        err.status === 404
          ? stateMessage(
              "empty",
              `There is no run called “${runId}”.`,
              el("p", {}, "It may have been pruned, or the link has a typo. "),
              el("p", {}, el("a", { href: "#/" }, "See all runs")),
            )
          : stateMessage(
              "error",
              `Could not load run ${runId}.`,
              el("p", {}, `The server said: ${err.message}.`),
              el(
                "button",
                {
                  type: "button",
                  onclick: () => {
                    clear(main).append(stateMessage("loading", "Loading…"));
                    load();
                  },
                },
                "Try again",
              ),
            ),
      );
    }
  }

  const unsubscribe = onRunChange((run) => {
    if (run.run === runId && parts) refresh();
  });
  let resizing = null;
  const onResize = () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      if (!parts) return;
      drawVisuals();
      parts.flight.redraw();
    }, 200);
  };
  window.addEventListener("resize", onResize);
  load();
  return () => {
    alive = false;
    unsubscribe();
    window.removeEventListener("resize", onResize);
  };
}
