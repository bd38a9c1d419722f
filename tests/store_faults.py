"""Store faults for tests: an S3 endpoint whose writes never return."""
from __future__ import annotations

import http.server
import threading
import time
import urllib.error
import urllib.request


class StallingS3:
    """An S3 endpoint in front of moto that forwards every request but never answers a PUT
    under `checkpoints/` (a write that never returns: a dead NFS, a stalled object store)."""

    def __init__(self, upstream: str):
        stalling = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT" and "/checkpoints/" in self.path:
                    stalling.stalled += 1
                    time.sleep(3600)
                req = urllib.request.Request(upstream + self.path, data=body or None, method=self.command,
                                             headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                try:
                    with urllib.request.urlopen(req) as r:
                        status, headers, data = r.status, r.headers, r.read()
                except urllib.error.HTTPError as err:
                    status, headers, data = err.code, err.headers, err.read()
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def log_message(self, *args):
                pass

        self.stalled = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
