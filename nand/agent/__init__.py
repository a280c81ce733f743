"""The in-process agent: runs inside each training rank.

Data path: hooks → probes (device-side reductions) → step check (one host read
per optimizer step) → events → sinks (log, JSONL file, server transport).
"""
