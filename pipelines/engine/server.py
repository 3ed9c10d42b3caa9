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
- each connection has its own thread, at most `MAX_CONNECTIONS` at once (a connection past them
  is closed at once), and its request line and headers must arrive within `TIMEOUT_S` in all, so
  an idle or slow client (one byte at a time) stalls only itself and is dropped;
- an HTML page is sent with a Content-Security-Policy that runs only its own scripts: those it
  loads from this server or from `SCRIPT_HOSTS`, and its inline ones by hash. circuit-tracer's
  viewer puts labels from its URL (`?clerps=`, `?supernodes=`) into its tooltip as HTML, so a
  link could otherwise carry an `<img onerror=...>` that runs when a node is hovered.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import html.parser
import http
import http.server
import io
import ipaddress
import mimetypes
import os
import shutil
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from pipelines.engine.paths import INDEX

TIMEOUT_S = 20  # seconds a request line and its headers may take to arrive, and each send of the reply
MAX_CONNECTIONS = 32  # connections served at once (a browser opens about 6 per server)
# where circuit-tracer's viewer (its index.html) loads scripts from
SCRIPT_HOSTS = ("https://transformer-circuits.pub", "https://unpkg.com")
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
    """The regular file URL segments `parts` name under `root`, symlinks resolved; a last
    segment '' (a trailing slash) names a folder, which gives its index.html. A folder named
    without the slash gives the folder itself (the server redirects to the slash). None when
    missing, outside `root`, a file named with a slash, or a name the file system refuses
    (too long, not readable)."""
    slash = bool(parts) and parts[-1] == ""
    try:
        base = root.resolve(strict=True)
        target = base.joinpath(*(p for p in parts if p))
        if target.is_dir():
            target = target / INDEX if slash else target
        elif slash:
            return None
        target = target.resolve(strict=True)
        if not target.is_relative_to(base) or not (target.is_file() or (not slash and target.is_dir())):
            return None
    except (OSError, RuntimeError, ValueError):
        return None
    return target


class _InlineScripts(html.parser.HTMLParser):
    """The text of each inline <script> of a page (one without `src`)."""

    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.scripts: list[str] = []
        self._open: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "script" and not any(name == "src" for name, _ in attrs):
            self._open = []

    def handle_data(self, data):
        if self._open is not None:
            self._open.append(data)

    def handle_endtag(self, tag):
        if tag == "script" and self._open is not None:
            self.scripts.append("".join(self._open))
            self._open = None


def content_policy(page: bytes) -> str:
    """The Content-Security-Policy of the HTML `page` (UTF-8): scripts from this server, from
    `SCRIPT_HOSTS` and the page's own inline scripts by their sha256; no inline event handler
    or other inline script. 'unsafe-eval' stays allowed: d3.csvParse (the viewer's CSV reader)
    and Plotly build functions from strings of their own, and markup cannot call them."""
    # browsers hash a script's text after turning its line ends into \n
    text = page.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    parser = _InlineScripts()
    parser.feed(text)
    parser.close()
    hashes = ["'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'" for s in parser.scripts]
    return " ".join(["script-src 'self'", *SCRIPT_HOSTS, *hashes, "'unsafe-eval';"]) + " object-src 'none'; base-uri 'none'"


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each receive waiting only for what is left of one deadline, so that a
    request trickled a byte at a time cannot hold its thread past it."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


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

    def setup(self):
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.timeout))

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers: the last of the request a GET needs
        self.connection.settimeout(self.timeout)
        return ok

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
        if path is not None and path.is_dir():
            # a page's relative links resolve against its URL's folder, so that URL must end in '/'
            where, query = self.path.split("#", 1)[0].partition("?")[::2]
            self.send_response(http.HTTPStatus.MOVED_PERMANENTLY)
            self.send_header("Location", where + "/" + ("?" + query if query else ""))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        try:
            file = None if path is None else open(path, "rb")
        except OSError:  # replaced or removed since it was resolved
            file = None
        if file is None:
            self.send_error(http.HTTPStatus.NOT_FOUND)
            return
        with file:
            kind = TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            page = file.read() if kind.startswith("text/html") else None  # the policy hashes what is sent
            size = len(page) if page is not None else os.fstat(file.fileno()).st_size  # of the file opened
            self.send_response(http.HTTPStatus.OK)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(size))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-cache")
            if page is not None:
                self.send_header("Content-Security-Policy", content_policy(page))
            self.end_headers()
            if body and page is not None:
                self.wfile.write(page)
            elif body:
                shutil.copyfileobj(file, self.wfile)


class FolderServer(http.server.ThreadingHTTPServer):
    """A read-only threaded HTTP server of `mounts` (URL prefix ending in '/' -> folder; the
    longest matching prefix wins). Not started: call `serve_forever()`, then `shutdown()` and
    `server_close()`; or `run_until_interrupted`."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, mounts: dict[str, Path], host: str = "127.0.0.1", port: int = 0):
        self._open = 0
        self._open_lock = threading.Lock()
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
            if url.startswith(prefix):
                return resolve(folder, url[len(prefix):].split("/"))
            if url + "/" == prefix:
                return resolve(folder, [])
        return None

    def process_request(self, request, client_address):
        with self._open_lock:
            full = self._open >= self.max_connections
            self._open += not full
        if full:  # a thread per connection without a cap is a thread per attacker's connection
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1

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
