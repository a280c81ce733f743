// The runs page: every run with its state, live from the stream.

import { api, onRunChange } from "./api.js";
import { badge, RUN_STATES } from "./badges.js";
import { clear, el, stateMessage } from "./dom.js";
import { age, count, datetime, where } from "./format.js";

// Diverged runs first, then the ones that need a look, then the quiet ones.
const ATTENTION = { diverged: 0, stalled: 1, lost: 2, healthy: 3, finished: 4 };

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

function emptyState() {
  return stateMessage(
    "empty",
    "No runs yet.",
    el("p", {}, "Point a training job at this server and its ranks appear here as they start:"),
    el(
      "pre",
      { class: "snippet" },
      "NAND_SERVER=tcp://<this-host>:5557 torchrun --nproc-per-node 8 train.py",
    ),
    el(
      "p",
      {},
      "with ",
      el("code", {}, "watch = nand.watch(model, optimizer=opt)"),
      " in train.py. The page updates by itself.",
    ),
  );
}

function originCell(run) {
  const o = run.origin;
  if (!o) return el("td", { class: "muted" }, "—");
  return el(
    "td",
    { class: "origin-cell" },
    el("span", { class: "mono" }, where(o.module, o.module_type)),
    el("span", { class: "muted block" }, `rank ${o.rank} · step ${count(o.step)} · ${o.phase}`),
  );
}

function row(run, now, fresh) {
  const cls = [`row-${run.state}`, fresh ? "flash" : ""].join(" ");
  return el(
    "tr",
    { class: cls, dataset: { run: run.run } },
    el("th", { scope: "row" }, el("a", { href: `#/runs/${encodeURIComponent(run.run)}` }, run.run)),
    el("td", {}, badge(run.state)),
    el(
      "td",
      { class: "num", title: `${run.ranks_seen} of ${run.world_size} ranks have reported` },
      run.ranks_seen === run.world_size ? count(run.world_size) : `${run.ranks_seen}/${run.world_size}`,
    ),
    el("td", { class: "num" }, count(run.latest_step)),
    originCell(run),
    el("td", { class: "num" }, count(run.event_count)),
    el("td", { title: datetime(run.last_seen) }, age(run.last_seen, now)),
    el("td", { title: datetime(run.started_at) }, age(run.started_at, now)),
  );
}

export function runsPage(main, params) {
  document.title = "Runs · nand";
  const runs = new Map();
  const fresh = new Set();
  const view = {
    text: params.get("q") || "",
    state: params.get("state") || "",
    sort: params.get("sort") || "state",
    desc: params.get("desc") === "1",
  };
  let loaded = false;

  const search = el("input", {
    type: "search",
    placeholder: "Filter by run or module",
    "aria-label": "Filter runs by id or module",
    value: view.text,
  });
  const stateSelect = el(
    "select",
    { "aria-label": "Show runs in state" },
    el("option", { value: "" }, "All states"),
    RUN_STATES.map((s) => el("option", { value: s }, s)),
  );
  stateSelect.value = view.state;
  const counts = el("p", { class: "counts", "aria-live": "polite" });
  const body = el("div", { class: "runs-body" }, stateMessage("loading", "Loading runs…"));

  main.append(
    el(
      "div",
      { class: "page-head" },
      el("h1", {}, "Runs"),
      el("div", { class: "toolbar" }, search, stateSelect),
    ),
    counts,
    body,
  );

  function matches(run) {
    if (view.state && run.state !== view.state) return false;
    if (!view.text) return true;
    const needle = view.text.toLowerCase();
    return (
      run.run.toLowerCase().includes(needle) ||
      (run.origin && run.origin.module.toLowerCase().includes(needle))
    );
  }

  function sorted(list) {
    const col = COLUMNS.find((c) => c.key === view.sort) || COLUMNS[1];
    const dir = view.desc ? -1 : 1;
    return list.sort((a, b) => {
      const x = col.value(a);
      const y = col.value(b);
      const primary = x < y ? -1 : x > y ? 1 : 0;
      return primary * dir || b.last_seen - a.last_seen;
    });
  }

  function header() {
    return el(
      "thead",
      {},
      el(
        "tr",
        {},
        COLUMNS.map((col) => {
          const active = view.sort === col.key;
          return el(
            "th",
            {
              scope: "col",
              class: col.numeric ? "num" : "",
              "aria-sort": active ? (view.desc ? "descending" : "ascending") : "none",
            },
            el(
              "button",
              {
                type: "button",
                class: "sort",
                onclick: () => {
                  view.desc = active ? !view.desc : false;
                  view.sort = col.key;
                  render();
                  // The header was rebuilt: keep the keyboard where it was.
                  body.querySelector('th:not([aria-sort="none"]) button')?.focus();
                },
              },
              col.label,
              el("span", { class: "sort-mark", "aria-hidden": "true" }, active ? (view.desc ? "▼" : "▲") : ""),
            ),
          );
        }),
      ),
    );
  }

  function renderCounts(all) {
    const by = {};
    for (const r of all) by[r.state] = (by[r.state] || 0) + 1;
    clear(counts);
    if (!all.length) return;
    counts.append(`${count(all.length)} ${all.length === 1 ? "run" : "runs"}`);
    for (const state of RUN_STATES) {
      if (!by[state]) continue;
      counts.append(
        " · ",
        el(
          "button",
          {
            type: "button",
            class: `chip chip-${state}`,
            "aria-pressed": view.state === state ? "true" : "false",
            onclick: () => {
              view.state = view.state === state ? "" : state;
              stateSelect.value = view.state;
              render();
            },
          },
          `${by[state]} ${state}`,
        ),
      );
    }
  }

  function render() {
    if (!loaded) return;
    const all = [...runs.values()];
    renderCounts(all);
    clear(body);
    if (all.length === 0) {
      body.append(emptyState());
      return;
    }
    const shown = sorted(all.filter(matches));
    if (shown.length === 0) {
      body.append(stateMessage("empty", "No run matches this filter.", el("p", {}, "Clear the filter to see all runs.")));
      return;
    }
    const now = Date.now() / 1000;
    body.append(
      el(
        "div",
        { class: "table-wrap" },
        el(
          "table",
          { class: "runs" },
          header(),
          el("tbody", {}, shown.map((r) => row(r, now, fresh.has(r.run)))),
        ),
      ),
    );
    fresh.clear();
  }

  async function load() {
    clear(body).append(stateMessage("loading", "Loading runs…"));
    try {
      for (const run of await api.runs()) {
        const known = runs.get(run.run);
        if (!known || known.last_seen <= run.last_seen) runs.set(run.run, run);
      }
      loaded = true;
      render();
    } catch (err) {
      clear(body).append(
        stateMessage(
          "error",
          "Could not load the runs.",
          el("p", {}, `The server said: ${err.message}. Check that `, el("code", {}, "nand server"), " is running, then try again."),
          el("button", { type: "button", onclick: load }, "Try again"),
        ),
      );
    }
  }

  search.addEventListener("input", () => {
    view.text = search.value.trim();
    render();
  });
  stateSelect.addEventListener("change", () => {
    view.state = stateSelect.value;
    render();
  });

  // A stream message may arrive before the first load finishes; load() keeps
  // whichever copy of a run is newer.
  // Only a real change flashes its row: the stream also repeats what the
  // page already has when it (re)connects.
  const changed = (a, b) =>
    !a || a.state !== b.state || a.latest_step !== b.latest_step || a.event_count !== b.event_count;
  const unsubscribe = onRunChange((run) => {
    if (loaded && changed(runs.get(run.run), run)) fresh.add(run.run);
    runs.set(run.run, run);
    render();
  });
  const ticker = setInterval(render, 15000); // keep the ages true
  load();
  return () => {
    unsubscribe();
    clearInterval(ticker);
  };
}
