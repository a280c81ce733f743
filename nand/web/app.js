// The router: hash routes, so every view has a shareable URL and the server
// needs no fallback route.
//   #/                       all runs
//   #/runs/<run>?rank=3&...  one run (the query holds the event-table filters)

import { onStreamStatus } from "./api.js";
import { clear, el } from "./dom.js";
import { parseHash } from "./route.js";
import { hideTip } from "./tooltip.js";
import { runsPage } from "./runs.js";
import { hostsPage } from "./hosts.js";
import { runPage } from "./run.js";

const main = document.getElementById("main");
let unmount = null;

function notFound(path) {
  document.title = "Not found · nand";
  return el(
    "div",
    { class: "state-msg state-error", role: "alert" },
    el("p", { class: "state-title" }, "There is no page here."),
    el("p", {}, "The address ", el("code", {}, path), " is not a nand page. "),
    el("p", {}, el("a", { href: "#/" }, "See all runs")),
  );
}

function route() {
  if (unmount) unmount();
  unmount = null;
  hideTip();
  clear(main);
  const { path, params } = parseHash();
  const runMatch = path.match(/^\/runs\/(.+)$/);
  if (path === "/" || path === "/runs") unmount = runsPage(main, params);
  else if (runMatch) unmount = runPage(main, decodeURIComponent(runMatch[1]), params);
  else if (path === "/hosts") unmount = hostsPage(main);
  else main.append(notFound(path));
  const here = path === "/runs" ? "/" : path;
  for (const link of document.querySelectorAll(".topbar nav a")) {
    if (link.getAttribute("href") === `#${here}`) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

function showStreamStatus(status) {
  const badge = document.getElementById("live");
  badge.dataset.state = status;
  badge.textContent = {
    live: "live",
    connecting: "connecting…",
    reconnecting: "reconnecting…",
    offline: "offline",
  }[status];
  badge.title =
    status === "live"
      ? "Updates arrive as the server receives them"
      : "The live stream is down; the page retries by itself";
}

// The server also answers /runs/<id> with this page (shareable path links):
// turn such a path into the equivalent hash route.
if (location.pathname.startsWith("/runs/")) {
  history.replaceState(null, "", `/#${location.pathname}${location.search}`);
}

// Only a change of path re-mounts a view; a change of its query (the event
// filters, via setRouteParams) does not fire hashchange.
window.addEventListener("hashchange", route);
// The skip link must not change the hash: the hash is the route.
document.querySelector(".skip").addEventListener("click", (ev) => {
  ev.preventDefault();
  main.focus();
});
onStreamStatus(showStreamStatus);
route();
