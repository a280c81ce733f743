// State badges and the words that explain them.

import { el } from "./dom.js";

export const RUN_STATES = [
  "diverged", "replica_mismatch", "crashed", "stalled", "lost", "healthy", "finished",
];

/** Every run and rank state, in words (tests/web/test_vocabulary.py checks the list). */
export const STATE_WORDS = {
  healthy: "Every rank is reporting and every value so far is finite",
  diverged: "A rank saw a NaN or an infinity",
  replica_mismatch: "All finite, but a rank's parameters differ from the other replicas' (suspect its GPU)",
  stalled: "Ranks report, but the step count stopped moving",
  lost: "No message from some ranks for a while",
  finished: "Every rank said goodbye",
  crashed: "A rank exited with an exception (not a normal exit)",
  running: "Reporting, all values finite",
};

export function badge(state) {
  return el("span", { class: `badge badge-${state}`, title: STATE_WORDS[state] || state }, state);
}
