// The flight-recorder panel: which rank's window, which values, the heatmap.

import { api } from "./api.js";
import { clear, el, innerWidth, panel, stateMessage } from "./dom.js";
import { heatmap } from "./heatmap.js";

/** flightPanel(run, ranks, origin) -> {node, redraw}; shows the origin rank's window first. */
export function flightPanel(run, ranks, origin) {
  const body = el("div", { class: "flight-body" });
  // `ranks` may be one page of a big run: the origin is always offered.
  const head = origin ? (origin.rank ?? origin.ranks[0]) : null;
  const listed = head === null || ranks.some((r) => r.rank === head) ? ranks : [{ rank: head }, ...ranks];
  const rankSelect = el(
    "select",
    { "aria-label": "Flight recorder of rank" },
    listed.map((r) =>
      el("option", { value: r.rank }, `rank ${r.rank}${origin && r.rank === origin.rank ? " (origin)" : ""}`),
    ),
  );
  const which = el(
    "select",
    { "aria-label": "Values shown" },
    el("option", { value: "act" }, "layer outputs (forward)"),
    el("option", { value: "grad" }, "gradients (backward)"),
  );
  let flight = null;
  const show = () => {
    clear(body).append(heatmap(flight, origin, innerWidth(body), which.value));
  };
  const noWindow = () =>
    stateMessage(
      "empty",
      `No flight-recorder window from rank ${rankSelect.value}.`,
      el(
        "p",
        {},
        "A rank sends the last steps of per-layer values when it goes non-finite, or when the server asks for them.",
      ),
    );
  async function load() {
    const status = listed.find((r) => String(r.rank) === rankSelect.value);
    if (status && status.has_flight === false) {
      // The rank list says there is none: asking would only log a 404.
      flight = null;
      clear(body).append(noWindow());
      return;
    }
    clear(body).append(stateMessage("loading", "Loading the flight recorder…"));
    try {
      flight = await api.flight(run, rankSelect.value);
      show();
    } catch (err) {
      flight = null;
      clear(body).append(
        err.status === 404
          ? noWindow()
          : stateMessage(
              "error",
              "Could not load the flight recorder.",
              el("p", {}, `The server said: ${err.message}.`),
            ),
      );
    }
  }
  rankSelect.addEventListener("change", load);
  which.addEventListener("change", () => flight && show());
  if (origin) {
    rankSelect.value = String(origin.rank ?? origin.ranks[0]); // null: simultaneous, none first
    load();
  } else {
    // Ranks send a window when they go non-finite; before that there is
    // nothing to fetch unless the user picks a rank.
    body.append(
      stateMessage(
        "empty",
        "No incident, so no flight-recorder window yet.",
        el(
          "p",
          {},
          "A rank sends its last steps of per-layer values when it goes non-finite. Pick a rank above to look for one.",
        ),
      ),
    );
    rankSelect.prepend(el("option", { value: "", disabled: true }, "choose a rank"));
    rankSelect.value = "";
  }
  return {
    node: panel(
      "flight",
      "Flight recorder",
      "max |x| per layer over the last steps before the incident, on a log colour scale.",
      el("div", { class: "toolbar" }, rankSelect, which),
      body,
    ),
    redraw: () => flight && show(),
  };
}
