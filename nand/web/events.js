// The event table: every non-finite observation of the run, filtered on the
// server (rank, phase, module, steps) and paginated. Filters live in the URL
// so a filtered view can be shared.

import { clear, el, stateMessage } from "./dom.js";
import { eventRows, fetchPage } from "./eventrows.js";
import { count } from "./format.js";
import { setRouteParams } from "./route.js";
import { PHASE_WORDS } from "./verdict.js";

const PHASES = Object.keys(PHASE_WORDS);
const PAGE_SIZES = [50, 200, 1000, 10000];
const FILTERS = ["rank", "phase", "module", "step_min", "step_max"];

/** The filter controls, by the name of the query parameter each one sets. A run
 * with more ranks than one page (`allRanks` false) gets a number field for the
 * rank, not a list of thousands. */
function filterInputs(ranks, allRanks) {
  const number = (label) =>
    el("input", {
      type: "number",
      min: 0,
      placeholder: label.toLowerCase(),
      "aria-label": label,
      class: "step-input",
    });
  const options = (label, values, name) => [
    el("option", { value: "" }, label),
    values.map((v) => el("option", { value: v }, name(v))),
  ];
  return {
    rank: allRanks
      ? el(
          "select",
          { "aria-label": "Rank" },
          options(
            "All ranks",
            ranks.map((r) => r.rank),
            (r) => `rank ${r}`,
          ),
        )
      : number("Rank"),
    phase: el(
      "select",
      { "aria-label": "Phase" },
      options("All phases", PHASES, (p) => p),
    ),
    module: el("input", {
      type: "search",
      list: "module-names",
      placeholder: "Module or parameter",
      "aria-label": "Module or parameter name",
    }),
    step_min: number("From step"),
    step_max: number("To step"),
  };
}

/** Mount the table in `root`; returns {changed, setRank} for the run page. */
export function eventTable(root, { run, ranks, allRanks = true, modules, originId, params }) {
  const state = {
    offset: Number(params.get("offset")) || 0,
    limit: Number(params.get("limit")) || PAGE_SIZES[0],
  };
  const inputs = filterInputs(ranks, allRanks);
  for (const key of FILTERS) inputs[key].value = params.get(key) || "";
  const sizeSelect = el(
    "select",
    { "aria-label": "Events per page" },
    PAGE_SIZES.map((n) => el("option", { value: n }, `${count(n)} per page`)),
  );
  if (!PAGE_SIZES.includes(state.limit))
    sizeSelect.append(el("option", { value: state.limit }, `${state.limit} per page`));
  sizeSelect.value = String(state.limit);
  const datalist = el(
    "datalist",
    { id: "module-names" },
    modules.map((m) => el("option", { value: m.name })),
  );
  const status = el("span", { class: "page-status", "aria-live": "polite" });
  const prev = el("button", { type: "button", onclick: () => go(state.offset - state.limit) }, "← Previous");
  const next = el("button", { type: "button", onclick: () => go(state.offset + state.limit) }, "Next →");
  const body = el("div", { class: "events-body" });
  const detail = el("div", { class: "detail-slot" });
  const notice = el(
    "button",
    { type: "button", class: "notice", hidden: true, onclick: () => load() },
    "New events arrived: show them",
  );

  const pager = el("div", { class: "pager" }, prev, status, next);
  root.append(
    el(
      "div",
      { class: "toolbar filters" },
      inputs.rank,
      inputs.phase,
      inputs.module,
      datalist,
      inputs.step_min,
      inputs.step_max,
      sizeSelect,
    ),
    notice,
    body,
    pager,
    detail,
  );

  function filters() {
    const f = {};
    for (const key of FILTERS) if (inputs[key].value !== "") f[key] = inputs[key].value.trim();
    return f;
  }

  function syncUrl() {
    const p = new URLSearchParams(filters());
    if (state.offset) p.set("offset", state.offset);
    if (state.limit !== PAGE_SIZES[0]) p.set("limit", state.limit);
    setRouteParams(p);
  }

  function go(offset) {
    state.offset = Math.max(0, offset);
    load();
  }

  let token = 0;
  async function load() {
    const mine = ++token; // a slow old answer must not overwrite a newer one
    notice.hidden = true;
    syncUrl();
    body.setAttribute("aria-busy", "true");
    if (!body.firstChild) body.append(stateMessage("loading", "Loading events…"));
    let page;
    try {
      page = await fetchPage(run, filters(), state.offset, state.limit);
    } catch (err) {
      if (mine !== token) return;
      body.removeAttribute("aria-busy");
      clear(body).append(
        stateMessage(
          "error",
          "Could not load the events.",
          el("p", {}, `The server said: ${err.message}.`),
          el("button", { type: "button", onclick: load }, "Try again"),
        ),
      );
      return;
    }
    if (mine !== token) return;
    const started = performance.now();
    body.removeAttribute("aria-busy");
    clear(detail);
    if (!page.items.length) {
      const filtered = Object.keys(filters()).length > 0;
      clear(body).append(
        stateMessage(
          "empty",
          filtered ? "No event matches these filters." : "No non-finite value has been seen in this run.",
          filtered ? el("p", {}, "Widen the filters to see more.") : null,
        ),
      );
    } else clear(body).append(eventRows(page, originId, detail));
    const last = Math.min(page.total, page.offset + page.items.length);
    status.textContent = page.total ? `${count(page.offset + 1)}–${count(last)} of ${count(page.total)}` : "";
    pager.hidden = page.total === 0;
    prev.disabled = page.offset <= 0;
    next.disabled = last >= page.total;
    // Exposed for the performance test and for anyone profiling a big page.
    root.dataset.renderMs = (performance.now() - started).toFixed(1);
    root.dataset.rows = String(page.items.length);
  }

  let typing = null;
  for (const key of FILTERS) {
    inputs[key].addEventListener(key === "rank" || key === "phase" ? "change" : "input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => go(0), key === "rank" || key === "phase" ? 0 : 300);
    });
  }
  sizeSelect.addEventListener("change", () => {
    state.limit = Number(sizeSelect.value);
    go(0);
  });

  load();
  return {
    /** The run got new events. A first page that is not full shows them at once:
     * an empty one would say "no non-finite value" under a red verdict, and one
     * with room holds every event, so the reader loses no row (the events of an
     * incident arrive from its ranks over a second or two). A full page, or a
     * later one, offers to load them rather than move rows under the reader. */
    changed: () => {
      if (state.offset === 0 && Number(root.dataset.rows || 0) < state.limit) load();
      else notice.hidden = false;
    },
    /** Show one rank's events (from a click on the health strip). */
    setRank: (rank) => {
      inputs.rank.value = String(rank);
      go(0);
    },
  };
}
