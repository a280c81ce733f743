// A canvas sized in CSS pixels and drawn at the screen's pixel density.

import { el } from "./dom.js";

export function hiDpiCanvas(width, height, label) {
  const canvas = el("canvas", { role: "img", "aria-label": label });
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  return { canvas, ctx };
}

/** Mouse position in the canvas's CSS pixels. */
export function pointer(canvas, ev) {
  const box = canvas.getBoundingClientRect();
  return { x: ev.clientX - box.left, y: ev.clientY - box.top };
}

/** Keep the end of a long dotted name: "…layers.5.mlp.fc2". */
export function fitLabel(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(`…${cut}`).width > width) cut = cut.slice(1);
  return `…${cut}`;
}
