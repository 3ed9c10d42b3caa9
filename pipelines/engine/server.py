"""Serving a run's folders over HTTP, the one implementation (`explore --serve`, `graph --serve`).

A server maps URL prefixes to folders (`mounts`) and only reads. Its threat model is a local
web page or local user poking at a server bound to this machine:

- a path is refused (404) unless it names a regular file inside its folder once every symlink is
  resolved; a `..` or `.` segment, an empty segment (`//`), a backslash, a null byte or a name
  starting with a dot is refused before the file system is asked, both as written and after
  percent-decoding, so encoded traversal fails the same way;
- the `Host` header must name the bound address and port (or `localhost` for a loopback
  address; any IP literal when bound to every interface): a page that rebinds its own DNS name
  to 127.0.0.1 is refused (DNS rebinding);
- only GET and HEAD exist: there is no write endpoint (any other method gets 501);
- each connection has its own thread and a socket timeout, so an idle or slow client stalls
  only itself and is dropped after `TIMEOUT_S`.
"""

from __future__ import annotations

import errno
import http
import http.server
import ipaddress
import mimetypes
import os
import shutil
import sys
import urllib.parse
from pathlib import Path

from pipelines.engine.paths import INDEX

TIMEOUT_S = 20  # seconds a connection may sit idle mid-request before it is closed
TYPES = {".js": "text/javascript; charset=utf-8", ".json": "application/json", ".html": "text/html; charset=utf-8",
         ".css": "text/css; charset=utf-8"}


def clean_parts(path: str) -> list[str] | None:
    """The segments of a URL path (its query and fragment dropped), or None when any is unsafe:
    empty (`//`), `.` or `..`, hidden (a leading dot), or holding a backslash or a null byte,
    checked as written and after percent-decoding. A trailing slash gives a last segment ''."""
    path = path.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        return None
    raw = path[1:].split("/")
    decoded = urllib.parse.unquote(path[1:], errors="strict").split("/") if "%" in path else raw
    if len(decoded) != len(raw):  # an encoded slash
        return None
    for i, parts in enumerate(zip(raw, decoded)):
        last = i == len(raw) - 1
        for part in parts:
            if (part == "" and not last) or part.startswith(".") or "\\" in part or "\x00" in part:
                return None
    return decoded


def resolve(root: Path, parts: list[str]) -> Path | None:
    """The regular file `parts` names under `root`, symlinks resolved, or None when it is
    missing, not a regular file or outside `root`; a folder gives its index.html."""
    base = root.resolve()
    target = base.joinpath(*parts)
    if target.is_dir():
        target = target / INDEX
    try:
        target = target.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if not target.is_relative_to(base) or not target.is_file():
        return None
    return target


def allowed_hosts(host: str, port: int) -> set[str] | None:
    """The `Host` header values a server bound to (host, port) accepts; None for a wildcard
    address, where any IP literal with the port is accepted."""
    address = ipaddress.ip_address(host)
    if address.is_unspecified:
        return None
    shown = f"[{host}]" if address.version == 6 else host
    names = {f"{shown}:{port}"}
    if address.is_loopback:
        names.add(f"localhost:{port}")
    return names


def host_ok(header: str | None, allowed: set[str] | None, port: int) -> bool:
    if not header:
        return False
    header = header.strip().lower()
    if allowed is not None:
        return header in allowed
    name, _, given = header.rpartition(":")
    if given != str(port):
        return False
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return name == "localhost"
    return True


class _Handler(http.server.BaseHTTPRequestHandler):
    timeout = TIMEOUT_S
    server: FolderServer

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def do_HEAD(self):
        self._send(body=False)

    def do_GET(self):
        self._send(body=True)

    def _send(self, body: bool) -> None:
        if not host_ok(self.headers.get("Host"), self.server.hosts, self.server.server_address[1]):
            self.send_error(http.HTTPStatus.MISDIRECTED_REQUEST, "Host header does not name this server")
            return
        try:
            parts = clean_parts(self.path)
        except UnicodeDecodeError:
            parts = None
        path = None if parts is None else self.server.find(parts)
        try:
            file = None if path is None else open(path, "rb")
        except OSError:  # replaced or removed since it was resolved
            file = None
        if file is None:
            self.send_error(http.HTTPStatus.NOT_FOUND)
            return
        with file:
            size = os.fstat(file.fileno()).st_size  # of the file opened, whatever replaced it since
            self.send_response(http.HTTPStatus.OK)
            self.send_header("Content-Type", TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0]
                             or "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            if body:
                shutil.copyfileobj(file, self.wfile)


class FolderServer(http.server.ThreadingHTTPServer):
    """A read-only threaded HTTP server of `mounts` (URL prefix ending in '/' -> folder; the
    longest matching prefix wins). Not started: call `serve_forever()`, then `shutdown()` and
    `server_close()`; or `run_until_interrupted`."""

    daemon_threads = True

    def __init__(self, mounts: dict[str, Path], host: str = "127.0.0.1", port: int = 0):
        self.mounts = sorted(((prefix, Path(folder)) for prefix, folder in mounts.items()), key=lambda m: -len(m[0]))
        try:
            super().__init__((host, port), _Handler)
        except OverflowError:
            raise ValueError(f"--port must be from 0 to 65535, not {port}") from None
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port}: the port is already in use on {host} (another server is running "
                                 "there: stop it, or pick another --port, 0 for any free one)") from None
            if err.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {host}: not an address of this machine") from None
            raise
        self.hosts = allowed_hosts(self.server_address[0], self.server_address[1])

    def find(self, parts: list[str]) -> Path | None:
        """The file URL segments `parts` name in the mounts, or None."""
        url = "/" + "/".join(parts)
        for prefix, folder in self.mounts:
            if url.startswith(prefix) or url + "/" == prefix:
                rest = url[len(prefix):].split("/") if url.startswith(prefix) else [""]
                return resolve(folder, [p for p in rest if p])
        return None

    def handle_error(self, request, client_address):
        # a client that hangs up or times out is its own business; anything else is a bug worth a traceback
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def run_until_interrupted(self, lines: list[str]) -> None:
        """Print `lines` (what is served where), serve until Ctrl-C, then say so and close."""
        with self:
            print("\n".join(lines) + " (Ctrl-C to stop)", flush=True)
            try:
                self.serve_forever()
            except KeyboardInterrupt:
                print("stopped")
