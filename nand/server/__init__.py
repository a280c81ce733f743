"""The central server: ingest (ZeroMQ) → store (SQLAlchemy) → correlate → REST API → web."""
