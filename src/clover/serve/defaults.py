"""The server's defaults, stated once: `create_app`, `serve`, the `Scheduler` and `clover serve`
read them. Only constants here, so the CLI can state them without importing fastapi."""

HOST = "127.0.0.1"
PORT = 8000
MAX_BATCH = 16  # rows decoded together (in flight across all engines)
MAX_QUEUE = 64  # rows that may wait beyond the batch before 429
MAX_BODY_BYTES = 4 * 1024 * 1024  # the largest request body (413 beyond)
