// The hosts page: which machines keep producing incidents, across runs
// (GET /api/hosts, nand/server/analysis/hosts.py). A "lemon" node sits at the top.

import { api } from "./api.js";
import { clear, el, stateMessage } from "./dom.js";
import { age, count } from "./format.js";

const COLUMNS = [
  ["incidents", "Runs whose lone origin of a non-finite value ran here"],
  ["mismatches", "Runs in which a rank here held parameters unlike the other replicas'"],
  ["crashes", "Ranks here that exited with an exception"],
  ["runs", "Recent runs with a rank here"],
];

export function hostsPage(main) {
  document.title = "Hosts · nand";
  const body = el("div", {}, stateMessage("loading", "Loading hosts…"));
  main.append(
    el("div", { class: "page-head" }, el("h1", {}, "Hosts")),
    el(
      "p",
      { class: "counts" },
      "Per machine, across recent runs: a host near the top run after run, whoever's job it was, is suspect.",
    ),
    body,
  );
  let alive = true;
  api
    .hosts()
    .then((page) => alive && show(body, page))
    .catch((err) => alive && show(body, null, err));
  return () => {
    alive = false;
  };
}

function show(body, page, err) {
  clear(body);
  if (err) {
    body.append(stateMessage("error", "Could not load the hosts.", err.message));
    return;
  }
  if (!page.items.length) {
    body.append(stateMessage("empty", "No host has reported yet."));
    return;
  }
  body.append(
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { class: "runs hosts" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            el("th", { scope: "col" }, "Host"),
            COLUMNS.map(([name, title]) => el("th", { scope: "col", title, class: "num" }, name)),
            el("th", { scope: "col" }, "GPUs with trouble"),
            el("th", { scope: "col" }, "Last seen"),
          ),
        ),
        el("tbody", {}, page.items.map(hostRow)),
      ),
    ),
    el("p", { class: "counts" }, `${count(page.total)} hosts over the last ${count(page.runs)} runs.`),
  );
}

function hostRow(host) {
  const trouble = host.incidents + host.mismatches + host.crashes > 0;
  return el(
    "tr",
    { "data-host": host.host, class: trouble ? "row-diverged" : "" },
    el("th", { scope: "row" }, host.host),
    COLUMNS.map(([name]) => el("td", { class: "num" }, count(host[name]))),
    el("td", {}, gpuText(host.gpus)),
    el("td", {}, age(host.last_seen)),
  );
}

function gpuText(gpus) {
  return gpus
    .filter((g) => g.incidents || g.mismatches || g.crashes)
    .map((g) => `GPU ${g.gpu}: ${g.incidents} incidents, ${g.mismatches} mismatches, ${g.crashes} crashes`)
    .join("; ");
}
