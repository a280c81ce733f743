"""The central server: ingest (ZeroMQ) → store (SQLAlchemy) → correlate → REST API → web.

The data path, one module each::

    ingest.py     ROUTER socket thread: decode + validate (nand.wire), auth, batch, ack
    admission.py  who may speak for an agent id  leases.py  ...across servers (a DB lease)
    writer.py     one batch → one transaction: dedup by (agent, seq), rows, first events
    runlock.py    one server at a time per run for the cross-rank comparisons
    rows.py       wire message → table row (pure)            sanitize.py  storable values
    commander.py  stop / send_flight commands to agents
    models.py     tables (SQLAlchemy 2.0)   migrations/ + migrate.py  Alembic, run at start
    store.py      queries                   views.py     rows → REST bodies (schemas.py)
    origins.py    event rows → events, the non-finite origin as a body
    runsummary.py the one run summary       rankpage.py  a big run's ranks, by light queries
    correlate.py  origin, per-rank relation, hint, states   evidence.py  flight windows
    failures.py   a run's failures in time order: the first is the origin
    summary.py    the sentences             stoprule.py  the default stop step
    api/          one router per resource   app.py       create_app() + lifespan
    embedded.py   a whole server in a thread on free ports  commands.py  the CLI

Start one with ``nand server`` or, from Python, :func:`nand.server.embedded.start`.
"""
