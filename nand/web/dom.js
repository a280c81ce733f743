// Tiny element builders. Every piece of data enters the page through
// text nodes (textContent), never as HTML, so a module name or a message
// from a training job can never inject markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function apply(node, props) {
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.setAttribute("class", value);
    else if (key === "text") node.textContent = String(value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else node.setAttribute(key, value === true ? "" : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** el("a", {href: "#/", class: "x"}, "text", otherNode) */
export function el(tag, props, ...children) {
  const node = document.createElement(tag);
  apply(node, props);
  append(node, children);
  return node;
}

/** The same for SVG elements (they need their namespace). */
export function svg(tag, props, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  apply(node, props);
  append(node, children);
  return node;
}

export function clear(node) {
  node.replaceChildren();
  return node;
}

/** A message block for loading, empty and error states. */
export function stateMessage(kind, title, ...details) {
  return el(
    "div",
    { class: `state-msg state-${kind}`, role: kind === "error" ? "alert" : "status" },
    el("p", { class: "state-title" }, title),
    details,
  );
}

/** Read a CSS custom property, so canvas drawings follow the theme. */
export function cssVar(name, node = document.documentElement) {
  return getComputedStyle(node).getPropertyValue(name).trim();
}

/** A titled section of a page, with an optional note beside the title. */
export function panel(id, title, note, ...content) {
  return el(
    "section",
    { class: "panel", id, "aria-labelledby": `${id}-title` },
    el(
      "div",
      { class: "panel-head" },
      el("h2", { id: `${id}-title` }, title),
      note ? el("p", { class: "muted" }, note) : null,
    ),
    content,
  );
}

/** The width a drawing may take inside `node` (already in the page). */
export function innerWidth(node) {
  return Math.max(320, node.clientWidth);
}
