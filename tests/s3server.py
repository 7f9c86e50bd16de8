"""A real S3-compatible server for tests, and a proxy in front of it that misbehaves on purpose.

    with MotoServer() as moto:                       # moto's standalone server on 127.0.0.1
        env = aws_env(moto.endpoint)                  # what boto3 needs to talk to it
        proxy = FaultProxy(moto.port, fail_every=3).start()   # every 3rd request: 503 SlowDown / 500
        ...                                           # point AWS_ENDPOINT_URL at proxy.endpoint
        proxy.kill()                                  # the server "dies": connections drop, refused
        proxy.restart()                               # back on the same port, faults off

The server runs in its own process (boto3 in the test and moto do not share a GIL); the proxy is
threads in the test process. Both listen on 127.0.0.1 only.
"""
from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from dist import free_port

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "expect", "content-length"}


def aws_env(endpoint: str) -> dict[str, str]:
    """Environment for boto3 (and spawned ranks) to use the server at `endpoint` with dummy keys."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


# Unset so that the settings of the machine running the tests do not leak in.
AWS_ENV_TO_CLEAR = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS",
                    "AWS_RETRY_MODE", "OMNICKPT_S3_PART_SIZE")


class MotoServer:
    """moto's standalone S3 server (`python -m moto.server`) on a free port of 127.0.0.1 (or of
    `host`: an address of this machine, such as a simulated machines' storage network's)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "MotoServer":
        for _ in range(3):  # the free port may be taken by someone else before moto binds it
            self.port = free_port()
            cmd = [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self._proc.poll() is None:
                if _answers(self.port, self.host):
                    return self
                time.sleep(0.05)
            self.stop()
        self._log.seek(0)
        raise RuntimeError(f"moto server did not start:\n{self._log.read().decode(errors='replace')[-2000:]}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        self._log.close()


def _answers(port: int, host: str = "127.0.0.1") -> bool:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=2)
        conn.request("GET", "/moto-api/")
        conn.getresponse().read()
        conn.close()
        return True
    except OSError:
        return False


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that forwards to the S3 server on `upstream_port` and breaks
    some requests, deterministically (counted over all requests it receives):

    fail_every=n      every n-th request is answered without forwarding: 503 SlowDown and 500
                      InternalError in turn (S3's throttling and server errors);
    lose_every=n      every n-th request is forwarded, then its answer replaced by a 500 (the server
                      did the work, the client does not know: retries must be idempotent);
    lose_when=pred    the same for each request for which pred(method, path) is true;
    truncate_every=n  every n-th forwarded GET with a body sends half the body, then closes the
                      connection (a download that breaks mid-way);
    die_when=pred     on the first request for which pred(method, path) is true, the server dies:
                      that request and every open connection are dropped, new ones refused.

    Counters (requests, failed, lost, truncated) and the `died` event let tests check that the
    faults really happened.
    """

    def __init__(self, upstream_port: int, *, fail_every: int = 0, lose_every: int = 0, truncate_every: int = 0,
                 lose_when: Callable[[str, str], bool] | None = None,
                 die_when: Callable[[str, str], bool] | None = None):
        self.upstream_port = upstream_port
        self.fail_every, self.lose_every, self.truncate_every = fail_every, lose_every, truncate_every
        self.lose_when, self.die_when = lose_when, die_when
        self.requests = self.failed = self.lost = self.truncated = 0
        self.died = threading.Event()
        self.port = 0
        self._gets = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._conns: set[socket.socket] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> "FaultProxy":
        server = ThreadingHTTPServer(("127.0.0.1", port), _ProxyHandler)
        server.daemon_threads = True
        server.proxy = self
        self._server = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name=f"fault-proxy-{self.port}").start()
        return self

    def kill(self) -> None:
        """Die abruptly: stop listening and cut every open connection."""
        self.died.set()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def restart(self) -> "FaultProxy":
        """Come back on the same port with every fault switched off."""
        self.fail_every = self.lose_every = self.truncate_every = 0
        self.lose_when = self.die_when = None
        self.died.clear()
        return self.start(self.port)

    def stop(self) -> None:
        if self._server is not None:
            self.kill()

    # -- called by the handler threads
    def _decide(self, method: str, path: str) -> str:
        with self._lock:
            self.requests += 1
            n = self.requests
            if self.die_when is not None and not self.died.is_set() and self.die_when(method, path):
                return "die"
            if self.fail_every and n % self.fail_every == 0:
                self.failed += 1
                return "slowdown" if self.failed % 2 else "error"
            if (self.lose_every and n % self.lose_every == 0) or (self.lose_when and self.lose_when(method, path)):
                self.lost += 1
                return "lose"
            if method == "GET" and self.truncate_every:
                self._gets += 1
                if self._gets % self.truncate_every == 0:
                    return "truncate"
            return "forward"


_ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
           "error": (500, "InternalError", "We encountered an internal error. Please try again."),
           "lose": (500, "InternalError", "The answer to this request was lost on purpose.")}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"     # keep-alive, and 100-continue for boto3's uploads

    def setup(self):
        super().setup()
        with self.server.proxy._lock:
            self.server.proxy._conns.add(self.connection)
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        with self.server.proxy._lock:
            self.server.proxy._conns.discard(self.connection)
        if self._upstream is not None:
            self._upstream.close()

    def handle(self):
        try:
            super().handle()
        except OSError:   # the proxy died under this connection, or the client hung up
            self.close_connection = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():   # trailers
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _proxy(self):
        proxy: FaultProxy = self.server.proxy
        body = self._read_body()
        decision = proxy._decide(self.command, self.path)
        if decision == "die":
            proxy.kill()
            self.close_connection = True
            return
        if decision in ("slowdown", "error"):
            return self._answer_error(decision)
        status, headers, data = self._forward(body)
        if decision == "lose":
            return self._answer_error(decision)
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in _HOP_BY_HOP:
                self.send_header(k, v)
        if self.command == "HEAD":
            length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
            self.send_header("Content-Length", length)
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if decision == "truncate" and len(data) > 1:
            with proxy._lock:
                proxy.truncated += 1
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(data)

    def _forward(self, body: bytes):
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        for attempt in range(2):   # a kept-alive upstream connection may have been closed by moto
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection("127.0.0.1", self.server.proxy.upstream_port, timeout=60)
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                resp = self._upstream.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (http.client.HTTPException, OSError):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise

    def _answer_error(self, kind: str):
        status, code, message = _ERRORS[kind]
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
               f'<RequestId>fault-proxy</RequestId></Error>').encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)
