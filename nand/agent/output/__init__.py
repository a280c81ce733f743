"""Where findings go: the log, a JSONL file, the server (``sinks``), the
user's ``on_event`` callables (``hook``), behind one guarded ``session`` that
also carries heartbeats and server commands."""
