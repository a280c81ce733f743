# The nand server image: FastAPI + uvicorn + SQLAlchemy (+ psycopg), no torch.
#   docker build -t nand-server .
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY nand ./nand
RUN pip install --no-cache-dir ".[server,postgres]" \
    && useradd --create-home --uid 10001 nand

USER nand
WORKDIR /home/nand
EXPOSE 8080 5557
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"
CMD ["nand", "server", "--http", "0.0.0.0:8080", "--zmq", "tcp://0.0.0.0:5557"]
