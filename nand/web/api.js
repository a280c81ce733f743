// The REST API and the live stream. Paths are relative to the page, so the
// dashboard also works behind a reverse proxy that mounts nand under a prefix.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function url(path, params) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params || {})) {
    if (value !== undefined && value !== null && value !== "") query.set(key, String(value));
  }
  const qs = query.toString();
  return `api/${path}${qs ? `?${qs}` : ""}`;
}

async function failure(response) {
  // FastAPI puts the reason in {"detail": ...}; fall back to the status text.
  let detail = response.statusText || `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (typeof body.detail === "string") detail = body.detail;
    else if (Array.isArray(body.detail)) detail = body.detail.map((d) => d.msg).join("; ");
  } catch {
    /* not JSON: keep the status text */
  }
  return new ApiError(response.status, detail);
}

async function request(path, options = {}, params) {
  let response;
  try {
    response = await fetch(url(path, params), {
      ...options,
      headers: { Accept: "application/json", ...(options.headers || {}) },
    });
  } catch (err) {
    throw new ApiError(0, `the nand server did not answer (${err.message})`);
  }
  if (!response.ok) throw await failure(response);
  return response.json();
}

const runPath = (run, rest = "") => `runs/${encodeURIComponent(run)}${rest}`;

export const api = {
  runs: () => request("runs"),
  hosts: () => request("hosts", {}, { limit: 200 }),
  run: (run) => request(runPath(run)),
  /** A page of ranks: {items, total, limit, next_after, states}; `after`: ranks above it. */
  ranks: (run, params) => request(runPath(run, "/ranks"), {}, params),
  verdict: (run) => request(runPath(run, "/verdict")),
  series: (run) => request(runPath(run, "/series")),
  warnings: (run) => request(runPath(run, "/warnings")),
  flight: (run, rank) => request(runPath(run, "/flight"), {}, { rank }),
  events: (run, filters) => request(runPath(run, "/events"), {}, filters),
  stop: (run, token, body) =>
    request(runPath(run, "/stop"), {
      method: "POST",
      headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` },
      body: JSON.stringify(body),
    }),
};

// One EventSource for the whole page; views subscribe and unsubscribe as the
// router mounts them. The browser retries a dropped connection by itself, but
// gives up for good (readyState CLOSED) when an answer is not a stream, e.g. a
// 502/503 while the server or its proxy restarts: then this module opens a new
// one, after 1, 2, 4... up to 30 s (with jitter, so many tabs do not return in
// step). A new stream starts with every recent run's summary, so the page
// catches up on what it missed.
const listeners = new Set();
const statusListeners = new Set();
let source = null;
let status = "connecting";
let retries = 0;
const MAX_BACKOFF_MS = 30_000;

function setStatus(next) {
  status = next;
  for (const fn of statusListeners) fn(status);
}

function backoffMs(attempt) {
  const base = Math.min(MAX_BACKOFF_MS, 1000 * 2 ** attempt);
  return base / 2 + Math.random() * (base / 2);
}

function reconnectLater() {
  source.close();
  setStatus("reconnecting");
  setTimeout(connect, backoffMs(retries));
  retries += 1;
}

function connect() {
  source = new EventSource(url("stream"));
  source.addEventListener("open", () => {
    retries = 0;
    setStatus("live");
  });
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) reconnectLater();
    else setStatus("reconnecting"); // the browser is retrying this one itself
  });
  source.addEventListener("run", (message) => {
    let run;
    try {
      run = JSON.parse(message.data);
    } catch {
      return; // a malformed frame must not break the page
    }
    for (const fn of listeners) fn(run);
  });
}

/** Call fn(RunSummary) whenever a run changes; returns the unsubscribe function. */
export function onRunChange(fn) {
  if (!source) connect();
  listeners.add(fn);
  return () => listeners.delete(fn);
}

/** Call fn("live" | "reconnecting" | "connecting") now and on every change. */
export function onStreamStatus(fn) {
  if (!source) connect();
  statusListeners.add(fn);
  fn(status);
  return () => statusListeners.delete(fn);
}
