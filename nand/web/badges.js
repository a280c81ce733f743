// State badges and the words that explain them.

import { el } from "./dom.js";

export const RUN_STATES = ["diverged", "crashed", "stalled", "lost", "healthy", "finished"];

const EXPLAIN = {
  healthy: "Every rank is reporting and every value so far is finite",
  diverged: "A rank saw a NaN or an infinity",
  stalled: "Ranks report, but the step count stopped moving",
  lost: "No message from some ranks for a while",
  finished: "Every rank said goodbye",
  crashed: "A rank exited with an exception (not a normal exit)",
  running: "Reporting, all values finite",
};

export function badge(state) {
  return el("span", { class: `badge badge-${state}`, title: EXPLAIN[state] || state }, state);
}
