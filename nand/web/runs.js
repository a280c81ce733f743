// The runs page: every run with its state, live from the stream. The
// filter and the sort live in the URL, so a view can be shared.

import { api, onRunChange } from "./api.js";
import { RUN_STATES } from "./badges.js";
import { clear, el, stateMessage } from "./dom.js";
import { count } from "./format.js";
import { setRouteParams } from "./route.js";
import { runsTable, sortRuns } from "./runtable.js";

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

function loadError(err, retry) {
  return stateMessage(
    "error",
    "Could not load the runs.",
    el(
      "p",
      {},
      `The server said: ${err.message}. Check that `,
      el("code", {}, "nand server"),
      " is running, then try again.",
    ),
    el("button", { type: "button", onclick: retry }, "Try again"),
  );
}

function matches(run, view) {
  if (view.state && run.state !== view.state) return false;
  const needle = view.text.toLowerCase();
  return (
    !needle ||
    run.run.toLowerCase().includes(needle) ||
    Boolean(run.origin && run.origin.module.toLowerCase().includes(needle))
  );
}

/** "12 runs · [3 diverged] · [9 healthy]": the chips toggle the state filter. */
function stateCounts(all, view, onPick) {
  const by = {};
  for (const r of all) by[r.state] = (by[r.state] || 0) + 1;
  const chips = RUN_STATES.filter((s) => by[s]).map((state) => [
    " · ",
    el(
      "button",
      {
        type: "button",
        class: `chip chip-${state}`,
        "aria-pressed": String(view.state === state),
        onclick: () => onPick(state),
      },
      `${by[state]} ${state}`,
    ),
  ]);
  return all.length ? [`${count(all.length)} ${all.length === 1 ? "run" : "runs"}`, chips] : [];
}

// A stream message is news when it changes what the row shows.
const changed = (a, b) =>
  !a || a.state !== b.state || a.latest_step !== b.latest_step || a.event_count !== b.event_count;

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

  function update(change) {
    Object.assign(view, change);
    stateSelect.value = view.state;
    const p = new URLSearchParams();
    if (view.text) p.set("q", view.text);
    if (view.state) p.set("state", view.state);
    if (view.sort !== "state") p.set("sort", view.sort);
    if (view.desc) p.set("desc", "1");
    setRouteParams(p);
    render();
  }

  // Rows are rebuilt on every change; put the keyboard back where it was.
  function focused() {
    const active = document.activeElement;
    if (!body.contains(active)) return null;
    const row = active.closest("tr[data-run]");
    return row ? `tr[data-run="${CSS.escape(row.dataset.run)}"] a` : 'th:not([aria-sort="none"]) button';
  }

  function render() {
    if (!loaded) return;
    const focus = focused();
    const all = [...runs.values()];
    clear(counts).append(
      ...stateCounts(all, view, (state) => update({ state: view.state === state ? "" : state })).flat(
        Infinity,
      ),
    );
    const shown = sortRuns(
      all.filter((r) => matches(r, view)),
      view.sort,
      view.desc,
    );
    if (!all.length) clear(body).append(emptyState());
    else if (!shown.length)
      clear(body).append(
        stateMessage(
          "empty",
          "No run matches this filter.",
          el("p", {}, "Clear the filter to see all runs."),
        ),
      );
    else
      clear(body).append(
        runsTable(shown, {
          sort: view.sort,
          desc: view.desc,
          fresh,
          onSort: (sort, desc) => update({ sort, desc }),
        }),
      );
    fresh.clear();
    if (focus) body.querySelector(focus)?.focus();
  }

  async function load() {
    clear(body).append(stateMessage("loading", "Loading runs…"));
    try {
      for (const run of await api.runs()) {
        // The stream may have brought a newer copy while this was loading.
        const known = runs.get(run.run);
        if (!known || known.last_seen <= run.last_seen) runs.set(run.run, run);
      }
      loaded = true;
      render();
    } catch (err) {
      clear(body).append(loadError(err, load));
    }
  }

  search.addEventListener("input", () => update({ text: search.value.trim() }));
  stateSelect.addEventListener("change", () => update({ state: stateSelect.value }));
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
