// What the replay of the bad step found (nand.agent.rerun): the aten op and
// the user's line that made the value, and whether the replay made it again.
// Plain text: it goes into the page through el() (textContent).

/** "aten::log at train.py:42", or "" when the replay named no op. */
export function replayOp(e) {
  return e.op ? `${e.op} at ${e.source || "an unknown line"}` : "";
}

/** Where to look once the replay made the value again (as nand.events.replay_words). */
function lookAt(e) {
  if (e.phase === "input") return "it is in the batch";
  if (e.phase === "loss") return "look at the batch, the loss computation";
  return "look at the batch, the layer";
}

/** The replay's answer in words: reproduced or not, or why there was none. */
export function replayAnswer(e) {
  if (e.reproduced === true) return `reproduced by the replay: ${lookAt(e)}`;
  if (e.reproduced === false) return "not reproduced by the replay: suspect the device (a transient fault)";
  return e.replay || "not replayed";
}
