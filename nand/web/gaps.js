// A run with gaps says so: the messages its ranks dropped before the server had
// them (a long outage filled an agent's memory queue and disk spool, …), per
// rank and by reason. Shown only when there are any.

import { el, panel } from "./dom.js";
import { count } from "./format.js";

/** What each drop reason (nand.events.DROP_REASONS) means, for the column titles. */
export const REASON_WORDS = {
  queue_full: "the agent's memory queue was full (NAND_QUEUE_MAX)",
  spool_full: "the agent's disk spool was full while the server was unreachable (NAND_SPOOL_MAX_BYTES)",
  disk_full: "the disk under the agent's spool was full: what its memory could not hold",
  spool_error: "the agent could not write its disk spool",
  too_large: "a message was larger than a frame may be",
  encode_error: "a message could not be encoded",
  rejected: "the server rejected the agent (e.g. a wrong NAND_TOKEN)",
  closed: "a message came after the agent was closed",
  commands_full: "the server's commands piled up unread on the agent",
};

/** The reasons that occur in any rank, the most frequent first. */
function reasonsOf(gaps) {
  const totals = new Map();
  for (const g of gaps) {
    for (const [reason, n] of Object.entries(g.dropped)) totals.set(reason, (totals.get(reason) || 0) + n);
  }
  return [...totals.entries()].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1)).map(([r]) => r);
}

function table(gaps) {
  const reasons = reasonsOf(gaps);
  const head = el(
    "tr",
    {},
    el("th", { scope: "col" }, "Rank"),
    el("th", { scope: "col", class: "num" }, "Dropped"),
    reasons.map((r) => el("th", { scope: "col", class: "num reason", title: REASON_WORDS[r] || "reported by a newer agent" }, r)),
  );
  const rows = gaps.map((g) =>
    el(
      "tr",
      { dataset: { rank: String(g.rank) } },
      el("th", { scope: "row" }, `rank ${g.rank}`),
      el("td", { class: "num" }, count(g.messages_dropped)),
      reasons.map((r) => el("td", { class: "num" }, g.dropped[r] ? count(g.dropped[r]) : "—")),
    ),
  );
  return el("div", { class: "table-wrap" }, el("table", { class: "gaps" }, el("thead", {}, head), el("tbody", {}, rows)));
}

/** The panel under the verdict, or null for a run without gaps. */
export function gapsPanel(detail) {
  const gaps = detail.gaps || [];
  if (!gaps.length) return null;
  const ranks = gaps.length === 1 ? "1 rank" : `${count(gaps.length)} ranks`;
  return panel(
    "gaps",
    `Gaps: ${count(detail.messages_dropped)} ${detail.messages_dropped === 1 ? "message" : "messages"} dropped by ${ranks}`,
    "These never reached the server: the events, curves and strip below miss what was in them.",
    table(gaps),
  );
}

/** One plain sentence for the verdict card, or null. */
export function gapsNote(verdict) {
  if (!verdict.gaps_summary) return null;
  return el("p", { class: "gaps-note", role: "note" }, verdict.gaps_summary);
}
