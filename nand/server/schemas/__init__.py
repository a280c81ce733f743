"""The REST API's response and request bodies, one module per resource: the
contract the dashboard and schedulers rely on. Separate from the database
tables (``nand.server.storage.models``); built by ``nand.server.analysis``,
served by ``nand.server.http``.

Floats that were NaN/inf on the wire are ``null`` here (JSON has no NaN);
counts (``nan``, ``posinf``, ``neginf``) say what the values were.
Times are Unix seconds (float, UTC). Every integer a request carries is
bounded by what the store holds (``nand.server.storage.bounds``).
"""
