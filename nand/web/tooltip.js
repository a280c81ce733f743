// One floating tooltip shared by the canvas and SVG views.

import { el } from "./dom.js";

const tip = () => document.getElementById("tooltip");

/** Show lines of text near the page position (x, y); a line may be [label, value]. */
export function showTip(lines, x, y) {
  const node = tip();
  node.replaceChildren(
    ...lines.map((line) =>
      Array.isArray(line)
        ? el("div", { class: "tip-row" }, el("span", { class: "tip-key" }, line[0]), el("b", {}, line[1]))
        : el("div", { class: "tip-head" }, line),
    ),
  );
  node.hidden = false;
  // Keep it inside the viewport: flip to the left/top near the edges.
  const { innerWidth: w, innerHeight: h } = window;
  const box = node.getBoundingClientRect();
  const left = x + 14 + box.width > w ? x - box.width - 14 : x + 14;
  const top = y + 14 + box.height > h ? y - box.height - 14 : y + 14;
  node.style.left = `${Math.max(4, left) + window.scrollX}px`;
  node.style.top = `${Math.max(4, top) + window.scrollY}px`;
}

export function hideTip() {
  tip().hidden = true;
}
