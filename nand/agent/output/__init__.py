"""Where findings go: the log, a JSONL file, the server (``sinks``), behind
one guarded ``session`` that also carries heartbeats and server commands."""
