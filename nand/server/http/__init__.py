"""HTTP: the FastAPI app, its guards and limits, the event streams, the routers."""
