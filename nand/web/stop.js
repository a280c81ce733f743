// The Stop button: asks for the server's token, confirms, and shows the step
// boundary at which every rank agreed to stop. The token stays in this page's
// memory only; it is never written to storage.

import { api } from "./api.js";
import { el } from "./dom.js";
import { count, rankList } from "./format.js";

function explain(err) {
  if (err.status === 401) return "The server refused this token: use the NAND_TOKEN it was started with.";
  if (err.status === 403) return `Stopping is turned off on this server (${err.message}).`;
  if (err.status === 404) return `The server does not know this run (${err.message}).`;
  if (err.status === 409) return `The run cannot be stopped now (${err.message}).`;
  return `The stop request failed: ${err.message}.`;
}

/** stopButton(run, onStopped) -> {node, sync(run)}; onStopped(StopResponse) after
 * success. The page keeps one for its whole life and calls sync() on live
 * updates: rebuilding it would close a dialog someone is typing a token into. */
export function stopButton(run, onStopped) {
  const token = el("input", {
    type: "password",
    name: "token",
    required: true,
    autocomplete: "off",
    spellcheck: "false",
  });
  const reason = el("input", {
    type: "text",
    name: "reason",
    maxlength: 500,
    placeholder: "e.g. diverged at step 4711",
  });
  const step = el("input", {
    type: "number",
    name: "step",
    min: 0,
    placeholder: "next step every rank can reach",
  });
  const error = el("p", { class: "form-error", role: "alert", hidden: true });
  const result = el("div", { class: "stop-result", role: "status", "aria-live": "polite" });
  const submit = el("button", { type: "submit", class: "danger" }, "Stop the run");
  const cancel = el("button", { type: "button", onclick: () => dialog.close() }, "Cancel");
  const form = el(
    "form",
    { method: "dialog", class: "stop-form" },
    el("h2", {}, "Stop run ", el("code", {}, run.run)),
    el(
      "p",
      {},
      `Every one of the ${count(run.world_size)} ranks stops at the same optimizer-step boundary, so checkpoints stay consistent. This cannot be undone from here.`,
    ),
    el(
      "label",
      {},
      el("span", {}, "Token ", el("span", { class: "muted" }, "(the server's NAND_TOKEN)")),
      token,
    ),
    el("label", {}, el("span", {}, "Reason ", el("span", { class: "muted" }, "(optional)")), reason),
    el("label", {}, el("span", {}, "At step ", el("span", { class: "muted" }, "(optional)")), step),
    error,
    el("div", { class: "actions" }, cancel, submit),
  );
  const dialog = el("dialog", { class: "stop-dialog", "aria-label": `Stop run ${run.run}` }, form, result);

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    error.hidden = true;
    if (!token.value) {
      error.textContent = "Enter the token to stop the run.";
      error.hidden = false;
      token.focus();
      return;
    }
    // The confirmation: the dialog already explained the consequences; this
    // second look names the run, so a stop never goes to the wrong tab.
    if (!submit.dataset.confirm) {
      submit.dataset.confirm = "1";
      submit.textContent = `Yes, stop ${run.run}`;
      submit.focus();
      return;
    }
    submit.disabled = true;
    const body = { reason: reason.value.trim() };
    if (step.value !== "") body.step = Number(step.value);
    try {
      const agreed = await api.stop(run.run, token.value, body);
      form.hidden = true;
      result.replaceChildren(
        el("h2", {}, "Stop agreed"),
        el(
          "p",
          { class: "agreed" },
          `Ranks ${rankList(agreed.ranks)} will stop at step `,
          el("strong", { class: "agreed-step" }, count(agreed.step)),
          " or the next step boundary after it.",
        ),
        el(
          "p",
          { class: "muted" },
          "Each rank stops when it reaches that step boundary; the dashboard shows it when they report.",
        ),
        el(
          "div",
          { class: "actions" },
          el("button", { type: "button", onclick: () => dialog.close() }, "Close"),
        ),
      );
      result.querySelector("button").focus();
      onStopped(agreed);
    } catch (err) {
      error.textContent = explain(err);
      error.hidden = false;
      delete submit.dataset.confirm;
      submit.textContent = "Stop the run";
      token.focus();
    } finally {
      submit.disabled = false;
    }
  });
  dialog.addEventListener("close", () => {
    token.value = "";
    delete submit.dataset.confirm;
    submit.textContent = "Stop the run";
    error.hidden = true;
  });

  const button = el(
    "button",
    {
      type: "button",
      class: "danger",
      onclick: () => {
        form.hidden = false;
        result.replaceChildren();
        dialog.showModal();
        token.focus();
      },
    },
    "Stop run…",
  );
  // The server says whether any rank can still receive a stop (none once every
  // rank has exited or is lost, whatever the run's state, "diverged" included).
  const sync = (latest) => {
    const verdict = latest.verdict || latest;
    button.disabled = verdict.stoppable === false;
    button.title = button.disabled ? "Every rank of this run has exited: there is nothing to stop" : "";
  };
  sync(run);
  return { node: el("span", { class: "stop" }, button, dialog), sync };
}
