"""The central server: ingest (ZeroMQ) → store (SQLAlchemy) → correlate → REST API → web.

Its sub-systems, one folder each, in layers (each imports only those below
it; the three at the top do not import each other; ``tests/server/test_layers.py``
holds them): storage ← schemas ← analysis ← metrics ← agents, http, notify::

    agents/    what the agents send and are sent
               ingest.py (ROUTER socket thread: decode, admit, batch, ack) → decoding.py,
               admission.py (who may speak for an agent id), leases.py (...across servers),
               gate.py + descriptors.py (connections under descriptor pressure),
               writer.py (one batch → one transaction: dedup by (agent, seq)) → stores.py
               (each kind's handlers), rows.py (wire message → storable row), attempts.py,
               announce.py (the log of who came and went), orders.py (stop, send_flight)
    storage/   models.py (tables), migrations/ + migrate.py (Alembic, run at start),
               store.py (queries), db.py (engines), runlock.py (one server per run),
               bounds.py + sanitize.py (values that fit the columns), bulk.py, runids.py
    schemas/   the REST bodies, one module per resource (runs, verdict, ranks...)
    analysis/  reads.py (summary, verdict, run detail: the small- or big-run path, chosen
               once), correlate.py (origin, relations), evidence.py, failures.py,
               summary.py (the sentences), origins.py, replicas.py, outliers.py, hosts.py,
               losses.py, alerts.py, stoprule.py, runsummary.py (the one run summary),
               views.py (rows → REST bodies), rankpage.py, bigrun.py + series.py (big runs)
    http/      app.py (create_app + lifespan: wires the rest), api/ (one router per
               resource), guard.py, bodylimit.py, asgi.py, timing.py, hub.py (event streams)
    notify/    notifier.py → detect.py (which runs changed) → send.py (webhooks)

Beside them: settings.py, embedded.py (a whole server in a thread on free ports),
metrics.py + observe.py (Prometheus), collector.py (the garbage collector's
settings), preflight.py. The command line that talks to a server is
``nand.cli``, apart from the server.

Start one with ``nand server`` or, from Python, :func:`nand.server.embedded.start`.
"""
