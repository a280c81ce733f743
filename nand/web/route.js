// The current hash route, split into a path and its query.

export function parseHash(hash = location.hash) {
  const raw = hash.replace(/^#/, "") || "/";
  const [path, query = ""] = raw.split("?");
  return { path, params: new URLSearchParams(query) };
}

/** Replace the query part of the current route without a new history entry. */
export function setRouteParams(params) {
  const { path } = parseHash();
  const qs = params.toString();
  history.replaceState(null, "", `#${path}${qs ? `?${qs}` : ""}`);
}
