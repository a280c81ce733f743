// The rows of the event table, built in one pass, with one listener for all
// of them so that a page of 10,000 rows stays cheap; and the page fetch.

import { api } from "./api.js";
import { clear, el } from "./dom.js";
import { datetime, num, stepLabel, tensorLabel, valueKinds } from "./format.js";
import { replayAnswer, replayOp } from "./replay.js";

const API_MAX = 1000; // the server's largest page; bigger pages are fetched in parts
const HEAD = ["Step", "Rank", "Phase", "Module / parameter", "Type", "Cause", "Values", "max |x|", "Tensor"];
const NUMERIC = new Set([0, 1, 7]);

/** One page of `limit` events from `offset`, in parts of at most API_MAX:
 * the first part says the total, so no part past the end is asked for. */
export async function fetchPage(run, filters, offset, limit) {
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

function cells(e, originId, first) {
  return el(
    "tr",
    { tabindex: first ? "0" : "-1", class: e.id === originId ? "origin-row" : "", dataset: { id: e.id } },
    el("td", { class: "num" }, stepLabel(e.step, e.micro_step)),
    el("td", { class: "num" }, String(e.rank)),
    el("td", {}, e.phase),
    el("td", { class: "mono wrap", title: e.module_type }, e.module || "(root)"),
    el("td", { class: "muted col-type" }, e.module_type),
    el("td", {}, el("span", { class: `cause cause-${e.cause}`, title: e.via ? `through ${e.via}` : "" }, e.cause)),
    el("td", {}, valueKinds(e)),
    el("td", { class: "num" }, num(e.max_abs)),
    el("td", { class: "muted tensor" }, tensorLabel(e)),
  );
}

function details(e) {
  const field = (k, v) => el("div", { class: "fact" }, el("dt", {}, k), el("dd", {}, v));
  return el(
    "div",
    { class: "event-detail", role: "region", "aria-label": "Selected event" },
    el(
      "p",
      { class: "mono" },
      e.message || `${e.phase} of ${e.module || "(root)"} at step ${stepLabel(e.step, e.micro_step)}`,
    ),
    el(
      "dl",
      { class: "facts small" },
      field("rank / world", `${e.rank} / ${e.world_size}`),
      field("host / pid", `${e.host || "?"} / ${e.pid}`),
      field("step.micro · order · call", `${stepLabel(e.step, e.micro_step)} · ${e.order} · ${e.call}`),
      field("values", valueKinds(e)),
      ...(e.via ? [field("received through", e.via)] : []),
      field("min · max · max|x|", `${num(e.min)} · ${num(e.max)} · ${num(e.max_abs)}`),
      field("tensor", tensorLabel(e)),
      field("made by", replayOp(e) || "—"),
      field("replay", replayAnswer(e)),
      field("seen", datetime(e.time)),
      field("seq", String(e.seq)),
    ),
  );
}

/** One Tab stop for the whole table (a "roving" tabindex), so the keyboard
 * does not have to walk through 10,000 rows to reach the pager: the arrow keys
 * move between rows, Home/End jump, Enter or Space shows the row's details. */
function onKey(ev, select) {
  const tr = ev.target.closest("tr");
  const body = tr.parentElement;
  const to = {
    ArrowDown: tr.nextElementSibling,
    ArrowUp: tr.previousElementSibling,
    Home: body.firstElementChild,
    End: body.lastElementChild,
  }[ev.key];
  if (ev.key === "Enter" || ev.key === " ") select(tr);
  else if (to) {
    tr.tabIndex = -1;
    to.tabIndex = 0;
    to.focus();
  } else return;
  ev.preventDefault();
}

/** The table of one page; a selected row's details go into `detail`. */
export function eventRows(page, originId, detail) {
  const rows = el(
    "tbody",
    {},
    page.items.map((e, i) => cells(e, originId, i === 0)),
  );
  const byId = new Map(page.items.map((e) => [String(e.id), e]));
  const select = (tr) => {
    const e = tr && byId.get(tr.dataset.id);
    if (!e) return;
    for (const old of rows.querySelectorAll("tr[aria-selected]")) old.removeAttribute("aria-selected");
    for (const old of rows.querySelectorAll('tr[tabindex="0"]')) old.tabIndex = -1;
    tr.setAttribute("aria-selected", "true");
    tr.tabIndex = 0;
    clear(detail).append(details(e));
  };
  rows.addEventListener("click", (ev) => select(ev.target.closest("tr")));
  rows.addEventListener("keydown", (ev) => onKey(ev, select));
  const head = el(
    "tr",
    {},
    HEAD.map((h, i) => el("th", { scope: "col", class: NUMERIC.has(i) ? "num" : h === "Type" ? "col-type" : "" }, h)),
  );
  return el("div", { class: "table-wrap" }, el("table", { class: "events" }, el("thead", {}, head), rows));
}
