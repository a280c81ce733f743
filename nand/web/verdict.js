// The verdict card: where the run first went non-finite, in words first,
// then the facts behind them.

import { el } from "./dom.js";
import { gapsNote } from "./gaps.js";
import { age, count, datetime, num, rankList, stepLabel, tensorLabel, valueKinds, where } from "./format.js";
import { replayAnswer, replayOp } from "./replay.js";

/** What each phase means, for people who have not read the event model. */
export const PHASE_WORDS = {
  input: "in the input batch entering the model",
  forward: "in the forward pass (a layer's output)",
  loss: "in the loss (the model's output was still finite)",
  backward: "in the backward pass (a gradient flowing out of a layer)",
  grad: "in a parameter's gradient after backward",
  param: "in a weight right after optimizer.step()",
  optimizer_state: "in the optimizer's state (e.g. Adam's moments)",
};

export const CAUSE_WORDS = {
  produced: "produced it from finite inputs",
  data: "received it in the input data",
  propagated: "passed on a non-finite input",
  received: "received it through a collective",
};

/** Verdict.hint -> what it means and what to try. */
const HINTS = {
  input_data: [
    "Bad input data",
    "The batch already held non-finite values before the model saw it: look at the data pipeline for this step, not at the model.",
  ],
  loss: [
    "The loss computation",
    "The model's output was finite; the loss made it non-finite (log of 0, division by zero, a masked mean over nothing).",
  ],
  overflow: [
    "Overflow",
    "Values grew until they passed the largest number the dtype can hold. Try a lower learning rate, bf16 instead of fp16, or gradient clipping.",
  ],
  gradient_explosion: [
    "Exploding gradients",
    "The gradient norm grew without bound before the failure. Try gradient clipping or a lower learning rate.",
  ],
  optimizer_update: [
    "The optimizer update",
    "The weights went non-finite in optimizer.step(): check eps, the learning-rate schedule and weight decay.",
  ],
  produced_in_layer: [
    "Made inside one layer",
    "This layer turned finite inputs into a non-finite output: look at its operations (division, log, sqrt, exp, softmax) and their inputs.",
  ],
};

function fact(label, ...value) {
  return el("div", { class: "fact" }, el("dt", {}, label), el("dd", {}, value));
}

function headline(verdict, run) {
  const o = verdict.origin;
  if (o && verdict.simultaneous) {
    return [
      `Ranks ${rankList(verdict.ranks_affected)} went non-finite together: `,
      el("strong", {}, valueKinds(o)),
      " in ",
      el("code", { class: "where" }, where(o.module, o.module_type)),
      ` during ${o.phase} at step ${stepLabel(o.step, o.micro_step)}`,
    ];
  }
  if (o) {
    const verb = o.cause === "received" ? "received" : o.cause === "data" ? "got" : "produced";
    return [
      `Rank ${o.rank} ${verb} `,
      el("strong", {}, valueKinds(o)),
      " in ",
      el("code", { class: "where" }, where(o.module, o.module_type)),
      ` during ${o.phase} at step ${stepLabel(o.step, o.micro_step)}`,
    ];
  }
  return {
    healthy: [`All finite so far, up to step ${count(run.latest_step)}.`],
    finished: ["Finished with every value finite."],
    stalled: firstFailure(verdict, "Stalled", "stopped making progress", "ranks are reporting but the step count stopped moving"),
    lost: firstFailure(verdict, "Lost", "stopped reporting", "some ranks stopped reporting"),
    crashed: firstFailure(verdict, "Crashed", "exited with an exception", "a rank exited with an exception, with every value finite"),
    diverged: ["Diverged."],
    replica_mismatch: replicaHeadline(verdict.replica),
  }[verdict.state];
}

/** "Lost: rank 1 stopped reporting first (step 5)": the first failure in time
 * (verdict.failures[0], the run's state); the summary names the later ones. */
function firstFailure(verdict, label, what, generic) {
  const first = (verdict.failures || [])[0];
  if (!first || first.state !== verdict.state) return [`${label}: ${generic}.`];
  const who = first.ranks.length === 1 ? `rank ${first.ranks[0]}` : `ranks ${rankList(first.ranks)}`;
  return [`${label}: ${who} ${what} first (step ${count(first.step)}).`];
}

/** "Rank 2's parameters differ from the other replicas' since step 40" (all finite). */
function replicaHeadline(replica) {
  if (!replica || replica.state !== "mismatch") return ["Replica mismatch."];
  const who = replica.ranks.length === 1
    ? `Rank ${replica.ranks[0]}'s parameters differ`
    : `Ranks ${rankList(replica.ranks)} hold different parameters`;
  const since = replica.last_good_step === null
    ? `at step ${count(replica.first_bad_step)}`
    : `between steps ${count(replica.last_good_step)} and ${count(replica.first_bad_step)}`;
  return [
    el("strong", {}, "Replica mismatch: "),
    `${who} from the other replicas' ${since}`,
    replica.params.length ? [" in ", el("code", { class: "where" }, replica.params.slice(0, 3).join(", "))] : "",
  ];
}

function originFacts(verdict, ranks) {
  const o = verdict.origin;
  const others = verdict.ranks_affected.filter((r) => r !== o.rank);
  const received = verdict.ranks_received;
  const produced = others.filter((r) => !received.includes(r));
  const facts = [
    // rank is null when several ranks went non-finite at the same point: none was first.
    o.rank == null
      ? fact("Origin rank", el("span", { class: "big" }, "none first"), el("span", { class: "muted block" }, `ranks ${rankList(o.ranks)} together`))
      : fact("Origin rank", el("span", { class: "big" }, String(o.rank))),
    fact("Step", el("span", { class: "big" }, stepLabel(o.step, o.micro_step))),
    fact(
      o.phase === "grad" || o.phase === "param" || o.phase === "optimizer_state" ? "Parameter" : "Layer",
      el("code", {}, o.module || "(root module)"),
      o.module_type ? el("span", { class: "muted" }, ` ${o.module_type}`) : null,
    ),
    fact("Phase", el("span", {}, o.phase), el("span", { class: "muted block" }, PHASE_WORDS[o.phase] || "")),
    fact("How", `${o.rank == null ? `ranks ${rankList(o.ranks)}` : `rank ${o.rank}`} ${CAUSE_WORDS[o.cause] || o.cause}`),
    fact(
      "Tensor",
      `${valueKinds(o)} in ${tensorLabel(o)}`,
      o.max_abs != null ? el("span", { class: "muted block" }, `largest finite |x| ${num(o.max_abs)}`) : null,
    ),
  ];
  if (o.op || o.reproduced != null)
    facts.push(fact("Made by", el("code", {}, replayOp(o) || "no single op"), el("span", { class: "muted block" }, replayAnswer(o))));
  const spread = [];
  if (verdict.simultaneous)
    spread.push(
      `ranks ${rankList(verdict.ranks_affected)} went non-finite at the same point: the model itself is unstable, not one rank`,
    );
  else {
    if (received.length)
      spread.push(
        `${received.length === ranks - 1 ? "every other rank" : `ranks ${rankList(received)}`} received it through a collective`,
      );
    if (produced.length) spread.push(`ranks ${rankList(produced)} produced their own later`);
    if (!others.length) spread.push(ranks > 1 ? "no other rank has gone non-finite" : "single-process run");
  }
  facts.push(fact("Other ranks", spread.join("; ")));
  facts.push(fact("When", datetime(o.time), el("span", { class: "muted block" }, age(o.time))));
  return facts;
}

/** The card; `ranks` is the world size, for "every other rank". */
export function verdictCard(verdict, run) {
  const card = el(
    "section",
    { class: `verdict verdict-${verdict.state}`, "aria-labelledby": "verdict-title" },
    el("h2", { id: "verdict-title", class: "verdict-title" }, headline(verdict, run)),
  );
  if (verdict.summary) card.append(el("p", { class: "summary" }, verdict.summary));
  const warned = verdict.warnings;
  if (warned && warned.count) {
    const kinds = Object.entries(warned.by_kind).map(([k, n]) => `${n} ${k.replace("_", " ")}`);
    card.append(
      el(
        "p",
        { class: "summary early-warnings" },
        `${count(warned.count)} early warning${warned.count === 1 ? "" : "s"} (${kinds.join(", ")}); first: `,
        `rank ${warned.first.rank}, ${warned.first.message}.`,
      ),
    );
  }
  // A run with gaps says so where the verdict is read: the evidence may be incomplete.
  const gaps = gapsNote(verdict);
  if (gaps) card.append(gaps);
  if (verdict.origin) card.append(el("dl", { class: "facts" }, originFacts(verdict, run.world_size)));
  const hint = HINTS[verdict.hint];
  if (hint) {
    card.append(
      el(
        "div",
        { class: "hint", role: "note" },
        el("span", { class: "hint-label" }, `Likely cause: ${hint[0]}`),
        el("p", {}, hint[1]),
      ),
    );
  } else if (verdict.hint) {
    card.append(
      el(
        "div",
        { class: "hint", role: "note" },
        el("span", { class: "hint-label" }, `Likely cause: ${verdict.hint}`),
      ),
    );
  }
  if (verdict.stop) {
    const s = verdict.stop;
    card.append(
      el(
        "p",
        { class: "stop-note" },
        // The server knew only the last heartbeat's step: a rank may already be past S.
        `Stop requested ${age(s.requested_at)}: every rank stops at step ${count(s.step)} or the next step boundary after it`,
        s.reason ? ` (${s.reason})` : "",
        s.stopped_at != null ? `; the ranks stopped at step ${count(s.stopped_at)}.` : ".",
      ),
    );
  }
  return card;
}
