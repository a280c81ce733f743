// The event table: every non-finite observation of the run, filtered on the
// server (rank, phase, module, steps) and paginated. Filters live in the URL
// so a filtered view can be shared.

import { api } from "./api.js";
import { setRouteParams } from "./route.js";
import { clear, el, stateMessage } from "./dom.js";
import { count, datetime, num, stepLabel, tensorLabel, valueKinds } from "./format.js";
import { PHASE_WORDS } from "./verdict.js";

const PHASES = Object.keys(PHASE_WORDS);
const PAGE_SIZES = [50, 200, 1000, 10000];
const API_MAX = 1000; // the server's largest page; bigger pages are fetched in parts
const FILTERS = ["rank", "phase", "module", "step_min", "step_max"];

/** One page of `limit` events from `offset`, in parts of at most API_MAX:
 * the first part says the total, so no part past the end is asked for. */
async function fetchPage(run, filters, offset, limit) {
  const part = (start) =>
    api.events(run, { ...filters, offset: start, limit: Math.min(API_MAX, offset + limit - start) });
  const first = await part(offset);
  const rest = [];
  for (let start = offset + API_MAX; start < Math.min(offset + limit, first.total); start += API_MAX) {
    rest.push(part(start));
  }
  const pages = [first, ...(await Promise.all(rest))];
  return { items: pages.flatMap((p) => p.items), total: first.total, offset, limit };
}

function cells(e, originId) {
  return el(
    "tr",
    { tabindex: "0", class: e.id === originId ? "origin-row" : "", dataset: { id: e.id } },
    el("td", { class: "num" }, stepLabel(e.step, e.micro_step)),
    el("td", { class: "num" }, String(e.rank)),
    el("td", {}, e.phase),
    el("td", { class: "mono wrap" }, e.module || "(root)"),
    el("td", { class: "muted" }, e.module_type),
    el("td", {}, el("span", { class: `cause cause-${e.cause}` }, e.cause)),
    el("td", {}, valueKinds(e)),
    el("td", { class: "num" }, num(e.max_abs)),
    el("td", { class: "muted" }, tensorLabel(e)),
  );
}

function details(e) {
  const field = (k, v) => el("div", { class: "fact" }, el("dt", {}, k), el("dd", {}, v));
  return el(
    "div",
    { class: "event-detail", role: "region", "aria-label": "Selected event" },
    el("p", { class: "mono" }, e.message || `${e.phase} of ${e.module || "(root)"} at step ${stepLabel(e.step, e.micro_step)}`),
    el(
      "dl",
      { class: "facts small" },
      field("rank / world", `${e.rank} / ${e.world_size}`),
      field("host / pid", `${e.host || "?"} / ${e.pid}`),
      field("step.micro · order · call", `${stepLabel(e.step, e.micro_step)} · ${e.order} · ${e.call}`),
      field("values", valueKinds(e)),
      field("min · max · max|x|", `${num(e.min)} · ${num(e.max)} · ${num(e.max_abs)}`),
      field("tensor", tensorLabel(e)),
      field("seen", datetime(e.time)),
      field("seq", String(e.seq)),
    ),
  );
}

/** Mount the table in `root`; returns {refresh, setRank} for the run page. */
export function eventTable(root, { run, ranks, modules, originId, params }) {
  const state = { offset: Number(params.get("offset")) || 0, limit: Number(params.get("limit")) || PAGE_SIZES[0] };
  const inputs = {
    rank: el("select", { "aria-label": "Rank" }, el("option", { value: "" }, "All ranks"), ranks.map((r) => el("option", { value: r.rank }, `rank ${r.rank}`))),
    phase: el("select", { "aria-label": "Phase" }, el("option", { value: "" }, "All phases"), PHASES.map((p) => el("option", { value: p }, p))),
    module: el("input", { type: "search", list: "module-names", placeholder: "Module or parameter", "aria-label": "Module or parameter name" }),
    step_min: el("input", { type: "number", min: 0, placeholder: "from step", "aria-label": "From step", class: "step-input" }),
    step_max: el("input", { type: "number", min: 0, placeholder: "to step", "aria-label": "To step", class: "step-input" }),
  };
  for (const key of FILTERS) inputs[key].value = params.get(key) || "";
  const sizeSelect = el("select", { "aria-label": "Events per page" }, PAGE_SIZES.map((n) => el("option", { value: n }, `${count(n)} per page`)));
  if (!PAGE_SIZES.includes(state.limit)) sizeSelect.append(el("option", { value: state.limit }, `${state.limit} per page`));
  sizeSelect.value = String(state.limit);
  const datalist = el("datalist", { id: "module-names" }, modules.map((m) => el("option", { value: m.name })));
  const status = el("span", { class: "page-status", "aria-live": "polite" });
  const prev = el("button", { type: "button", onclick: () => go(state.offset - state.limit) }, "← Previous");
  const next = el("button", { type: "button", onclick: () => go(state.offset + state.limit) }, "Next →");
  const body = el("div", { class: "events-body" });
  const detail = el("div", { class: "detail-slot" });
  const notice = el("button", { type: "button", class: "notice", hidden: true, onclick: () => load() }, "New events arrived: show them");

  const pager = el("div", { class: "pager" }, prev, status, next);
  root.append(
    el("div", { class: "toolbar filters" }, inputs.rank, inputs.phase, inputs.module, datalist, inputs.step_min, inputs.step_max, sizeSelect),
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

  function table(page) {
    const rows = el("tbody", {}, page.items.map((e) => cells(e, originId)));
    const byId = new Map(page.items.map((e) => [String(e.id), e]));
    const select = (tr) => {
      const e = tr && byId.get(tr.dataset.id);
      if (!e) return;
      for (const old of rows.querySelectorAll("tr[aria-selected]")) old.removeAttribute("aria-selected");
      tr.setAttribute("aria-selected", "true");
      clear(detail).append(details(e));
    };
    // One listener for all rows: a 10,000-row page stays cheap.
    rows.addEventListener("click", (ev) => select(ev.target.closest("tr")));
    rows.addEventListener("keydown", (ev) => {
      const tr = ev.target.closest("tr");
      if (ev.key === "Enter" || ev.key === " ") {
        ev.preventDefault();
        select(tr);
      } else if (ev.key === "ArrowDown" && tr.nextElementSibling) {
        ev.preventDefault();
        tr.nextElementSibling.focus();
      } else if (ev.key === "ArrowUp" && tr.previousElementSibling) {
        ev.preventDefault();
        tr.previousElementSibling.focus();
      }
    });
    const head = ["Step", "Rank", "Phase", "Module / parameter", "Type", "Cause", "Values", "max |x|", "Tensor"];
    return el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { class: "events" },
        el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { scope: "col", class: [0, 1, 7].includes(i) ? "num" : "" }, h)))),
        rows,
      ),
    );
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
      clear(body).append(stateMessage("error", "Could not load the events.", el("p", {}, `The server said: ${err.message}.`), el("button", { type: "button", onclick: load }, "Try again")));
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
    } else clear(body).append(table(page));
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
    /** The run got new events: offer to load them rather than move rows under the reader. */
    changed: () => {
      notice.hidden = false;
    },
    /** Show one rank's events (from a click on the health strip). */
    setRank: (rank) => {
      inputs.rank.value = String(rank);
      go(0);
    },
  };
}
