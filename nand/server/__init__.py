"""The central server: ingest (ZeroMQ) → store (SQLAlchemy) → correlate → REST API → web.

The data path, one module each::

    ingest.py     ROUTER socket thread: decode + validate (nand.wire), auth, batch, ack
    writer.py     one batch → one transaction: dedup by (agent, seq), rows, first events
    rows.py       wire message → table row (pure)            sanitize.py  storable values
    commander.py  stop / send_flight commands to agents
    models.py     tables (SQLAlchemy 2.0)   migrations/ + migrate.py  Alembic, run at start
    store.py      queries                   views.py     rows → REST bodies (schemas.py)
    correlate.py  origin, per-rank relation, hint, states   evidence.py  flight windows
    summary.py    the sentences             stoprule.py  the default stop step
    api/          one router per resource   app.py       create_app() + lifespan
    embedded.py   a whole server in a thread on free ports  commands.py  the CLI

Start one with ``nand server`` or, from Python, :func:`nand.server.embedded.start`.
"""
