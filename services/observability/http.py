"""/health and /metrics over plain HTTP for the roles without an API (scatter, combine, cache tier)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hybridcache.services.observability.metrics import scrape


def serve_health_and_metrics(host: str, port: int, health: Callable[[], dict],
                             idle_timeout_s: float = 10.0) -> ThreadingHTTPServer:
    """Serve in a thread; a connection that sends nothing for `idle_timeout_s` is closed (each
    connection holds a thread of its own)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = idle_timeout_s  # the socket's timeout: a read that waits longer ends the connection

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/metrics":
                body, ctype, code = scrape(), "text/plain; version=0.0.4", 200
            elif self.path == "/livez":  # liveness: the process answers; readiness is /health
                body, ctype, code = json.dumps({"status": "alive"}).encode(), "application/json", 200
            elif self.path == "/health":
                h = health()
                # anything but "ok" (e.g. "warming up") is not ready: 503, so a readiness probe waits
                code = 200 if h.get("status") == "ok" else 503
                body, ctype = json.dumps(h).encode(), "application/json"
            else:
                body, ctype, code = b'{"error": "not found"}', "application/json", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server
