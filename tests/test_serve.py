"""The one server of a run's files (`pipelines.engine.server`), as `graph --serve` and
`explore --serve` run it: attacks on its files, `Host` header, write endpoint and threads fail
(issue 51, items 1, 2, 4 and 11), by HTTP and from a page in Chromium; and the serve commands'
errors and messages (items 11, 12, 15)."""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.engine.paths import RunPaths
from pipelines.engine.server import FolderServer, clean_parts
from pipelines.graph.serve import graph_server

SECRET = "SECRET-OF-THE-RUN"


@pytest.fixture
def run(tmp_path):
    """A run with one graph, an explorer page, a secret file beside the graphs, symlinks out of
    the graphs folder, and a secret file outside the run."""
    root = tmp_path / "run"
    graphs = root / "graphs"
    (graphs / "features").mkdir(parents=True)
    (root / "lm").mkdir()
    (root / "lm" / "config.json").write_text(json.dumps({"secret": SECRET}))
    (tmp_path / "outside.json").write_text(json.dumps({"secret": SECRET}))
    (graphs / "g.json").write_text(json.dumps({"metadata": {"slug": "g"}, "nodes": [], "links": []}))
    (graphs / "features" / "7.json").write_text("{}")
    (graphs / "graph-metadata.json").write_text(json.dumps({"graphs": [{"slug": "g", "prompt": "p"}]}))
    (graphs / ".hidden.json").write_text(json.dumps({"secret": SECRET}))
    os.symlink(root / "lm" / "config.json", graphs / "link.json")
    os.symlink(root / "lm", graphs / "lm")
    (root / "explorer").mkdir()
    (root / "explorer" / "index.html").write_text("<p>explorer</p>")
    return root


@pytest.fixture
def served(run):
    server = graph_server(RunPaths(run), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def request(server, path: str, method: str = "GET", host: str | None = None, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, bytes]:
    """One request with `path` sent exactly as written (no client-side normalising)."""
    port = server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    host = f"127.0.0.1:{port}" if host is None else host
    if host:  # "" sends none
        conn.putheader("Host", host)
    for k, v in (headers or {}).items():
        conn.putheader(k, v)
    if body is not None:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


ATTACKS = [
    # item 1: traversal as written, with `//`, percent-encoded, through symlinks, hidden files
    "/viewer/data/../../lm/config.json", "/viewer/data/../../../../../../etc/passwd", "/viewer/data//etc/passwd",
    "/viewer/graph_data//etc/passwd", "//etc/passwd", "/viewer/data/%2e%2e/%2e%2e/lm/config.json",
    "/viewer/data/..%2f..%2flm%2fconfig.json", "/viewer/data/%2E%2E/lm/config.json", "/graphs/..%5c..%5clm/config.json",
    "/viewer/data/link.json", "/viewer/data/lm/config.json", "/graphs/link.json", "/viewer/data/.hidden.json",
    "/graphs/%2ehidden.json", "/viewer/../lm/config.json", "/../outside.json", "/viewer/data/g.json%00.html",
    "/viewer/data/%ff%fe", "relative/path",
    # item 11: folders are not files
    "/viewer/data/features/", "/graphs/",
]


@pytest.mark.parametrize("path", ATTACKS)
def test_nothing_outside_the_served_folders_is_read(served, path):
    status, body = request(served, path)
    assert status in (400, 404) and SECRET.encode() not in body, (path, status)


def test_the_viewer_and_the_graphs_are_served(served, run):
    for path, want in [("/viewer/index.html", b"Attribution Graphs"), ("/viewer/data/graph-metadata.json", b'"slug"'),
                       ("/viewer/graph_data/g.json", b'"nodes"'), ("/viewer/graph_data/features/7.json", b"{}"),
                       ("/graphs/g.json", b'"nodes"'), ("/", b"explorer"), ("/viewer/graph_data/g.json?x=1", b'"nodes"')]:
        status, body = request(served, path)
        assert status == 200 and want in body, path
    status, _ = request(served, "/viewer/data/g.json", host=f"localhost:{served.server_address[1]}")
    assert status == 200


def test_a_foreign_host_header_is_refused(served):
    """Item 1: a web page whose name now resolves to 127.0.0.1 (DNS rebinding) sends its own name."""
    port = served.server_address[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", f"127.0.0.1.nip.io:{port}", ""):
        status, body = request(served, "/viewer/data/g.json", host=host)
        assert status == 421 and b'"nodes"' not in body, host


def test_a_server_on_every_interface_takes_ip_literals_only():
    assert clean_parts("/a/b") == ["a", "b"] and clean_parts("/a/") == ["a", ""]
    server = FolderServer({"/": Path(__file__).parent}, "0.0.0.0", 0)
    try:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        assert request(server, "/test_serve.py", host=f"127.0.0.1:{port}")[0] == 200
        assert request(server, "/test_serve.py", host=f"rebind.example:{port}")[0] == 421
    finally:
        server.shutdown()
        server.server_close()


def test_no_request_writes_a_file(served, run):
    """Item 2: circuit-tracer's `POST /save_graph/SLUG` rewrote the graph and the index."""
    listing = lambda: sorted(str(p.relative_to(run)) for p in run.rglob("*"))  # noqa: E731
    before, names = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}, listing()
    body = json.dumps({"qParams": {"pinnedIds": ["x"]}, "graphs": []}).encode()
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/save_graph/g", "/save_graph/graph-metadata", "/viewer/save_graph/g", "/viewer/data/g.json"):
            status, _ = request(served, path, method, body=body, headers={"Content-Type": "text/plain"})
            assert status >= 400, (method, path)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before and listing() == names


def test_an_idle_connection_stalls_nobody(served):
    """Item 4: a client that connects and sends nothing must not block the next one."""
    idle = socket.create_connection(served.server_address[:2])
    try:
        start = time.monotonic()
        status, _ = request(served, "/viewer/data/g.json")
        assert status == 200 and time.monotonic() - start < 5
    finally:
        idle.close()


def test_an_idle_connection_is_dropped(run, monkeypatch):
    from pipelines.engine import server as module

    monkeypatch.setattr(module._Handler, "timeout", 0.5)
    server = graph_server(RunPaths(run), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        idle = socket.create_connection(server.server_address[:2])
        idle.settimeout(5)
        assert idle.recv(1) == b""  # closed by the server
        idle.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_folder_request_prints_no_traceback(served, capfd):
    """Item 11: `/data/features` gave a 200 line, then a 500 and a traceback in the terminal."""
    assert request(served, "/viewer/data/features/")[0] == 404
    assert request(served, "/viewer/graph_data/features/")[0] == 404
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err


def test_a_name_the_file_system_refuses_is_a_404_without_traceback(served, run, capfd):
    """A name longer than the file system takes (ENAMETOOLONG) or a folder it may not read
    (EACCES) was asked about outside the handler's error mapping: a traceback and an empty reply."""
    long = "a" * 300
    for path in ("/" + long, f"/viewer/{long}", f"/graphs/{long}/g.json", f"/viewer/data/{long}/"):
        assert request(served, path)[0] == 404, path
    if os.geteuid() != 0:  # root reads any folder
        locked = run / "graphs" / "locked"
        (locked / "inner").mkdir(parents=True)
        locked.chmod(0)
        try:
            for path in ("/graphs/locked/inner", "/graphs/locked/inner/", "/graphs/locked/x.json"):
                assert request(served, path)[0] == 404, path
        finally:
            locked.chmod(0o755)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err


def test_a_folder_without_its_slash_is_redirected_and_a_file_with_one_is_not_found(served):
    """Without the redirect, `/viewer` served index.html at a URL whose relative links
    (`./style.css`) resolve outside the viewer's folder; `/g.json/` served the file."""
    port = served.server_address[1]
    for path, where in [("/viewer", "/viewer/"), ("/viewer?slug=g", "/viewer/?slug=g"),
                        ("/viewer/data/features", "/viewer/data/features/"), ("/graphs", "/graphs/"),
                        ("/viewer/attribution_graph", "/viewer/attribution_graph/")]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        conn.close()
        assert (response.status, response.getheader("Location")) == (301, where), path
    assert request(served, "/viewer/")[0] == 200
    for path in ("/viewer/index.html/", "/graphs/g.json/", "/viewer/data/g.json/", "/viewer/style.css/"):
        assert request(served, path)[0] == 404, path


def _headers(server, path: str) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_html_pages_forbid_inline_script_but_their_own(served, run):
    """The viewer shows labels from its URL (`?clerps=`, `?supernodes=`) as HTML: a policy that
    runs only the page's own scripts keeps an `<img onerror>` there inert (the browser side is
    tests/test_graph.py's `test_script_in_the_viewers_url_runs_nothing`)."""
    import base64
    import hashlib
    import re

    from pipelines.graph.serve import viewer_assets

    html = (viewer_assets() / "index.html").read_text()
    inline = re.findall(r"<script>(.*?)</script>", html, re.S)
    hosts = {m.group(1) for m in re.finditer(r"<script src=['\"](https://[^/'\"]+)/", html)}
    assert inline and hosts  # the page this guards: one inline script, scripts from the web
    policy = _headers(served, "/viewer/index.html").getheader("Content-Security-Policy")
    script_src = next(d for d in policy.split(";") if d.split()[0] == "script-src").split()
    want = {"'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'" for s in inline}
    assert want <= set(script_src) and hosts <= set(script_src) and "'self'" in script_src
    assert "'unsafe-inline'" not in script_src and "'unsafe-hashes'" not in script_src and "*" not in script_src
    (run / "explorer" / "index.html").write_text("<p>x</p><script>go(1)</script><SCRIPT type=module>go(2)</SCRIPT>")
    policy = _headers(served, "/").getheader("Content-Security-Policy")
    for body in ("go(1)", "go(2)"):
        assert "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'" in policy
    assert _headers(served, "/graphs/g.json").status == 200


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes `sock` within `seconds` while the client sends `trickle` one
    byte every 0.2 s (a bounded local client: it stops after `seconds`)."""
    sock.settimeout(0.2)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        try:
            if sock.recv(1) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionError:
            return True
        if trickle:
            try:
                sock.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
            except (ConnectionError, BrokenPipeError):
                return True
            i += 1
    return False


def test_a_request_trickled_byte_by_byte_is_dropped_at_the_deadline(run, monkeypatch):
    """Slowloris: the timeout was per receive, so a byte every few seconds kept a thread forever;
    reading the request line and headers now has one deadline."""
    from pipelines.engine import server as module

    monkeypatch.setattr(module._Handler, "timeout", 1)
    server = graph_server(RunPaths(run), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        slow = socket.create_connection(server.server_address[:2])
        start = time.monotonic()
        try:
            assert _closed_within(slow, 4, b"GET /viewer/data/g.json HTTP/1.0\r\nX-A: " + b"a" * 200)
        finally:
            slow.close()
        assert time.monotonic() - start < 3
        assert request(server, "/viewer/data/g.json")[0] == 200  # a prompt client still gets its file
    finally:
        server.shutdown()
        server.server_close()


def test_connections_past_the_cap_are_closed_at_once(run, monkeypatch):
    """The thread count had no cap; past `max_connections` open ones a new connection is closed
    at once, and served again once the others go."""
    server = graph_server(RunPaths(run), 0)
    monkeypatch.setattr(server, "max_connections", 3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    idle = []
    try:
        idle = [socket.create_connection(server.server_address[:2]) for _ in range(3)]
        time.sleep(0.3)  # each has its thread
        extra = socket.create_connection(server.server_address[:2])
        try:
            assert _closed_within(extra, 3)
        finally:
            extra.close()
        for sock in idle:
            sock.close()
        time.sleep(0.3)
        assert request(server, "/viewer/data/g.json")[0] == 200
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ the commands


def serve_cli(run, *extra, capsys, monkeypatch, stop=True) -> tuple[int, str, str]:
    """`graph --serve` with serve_forever replaced by a Ctrl-C (after recording the server)."""
    seen = {}

    def interrupted(self, *args, **kwargs):
        seen["port"] = self.server_address[1]
        raise KeyboardInterrupt

    if stop:
        monkeypatch.setattr(FolderServer, "serve_forever", interrupted)
    code = main(["graph", "--out", str(run), "--serve", *extra])
    out, err = capsys.readouterr()
    return code, out, err, seen.get("port")


def test_port_zero_prints_the_real_port_and_ctrl_c_stops(run, capsys, monkeypatch):
    """Items 12 and 15: `--port 0` printed port 0; Ctrl-C exited 130 with 'run again to continue'."""
    code, out, err, port = serve_cli(run, "--port", "0", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and port and port > 0, (out, err)
    assert f"http://127.0.0.1:{port}/viewer/index.html?slug=g" in out and f"explorer: http://127.0.0.1:{port}/" in out
    assert "stopped" in out and "interrupted" not in err


@pytest.mark.parametrize("port", ["70000", "-1", "65536", "x"])
def test_port_out_of_bounds_is_one_line_naming_the_option(run, capsys, monkeypatch, port):
    """Item 11: an OverflowError traceback."""
    code, out, err, _ = serve_cli(run, "--port", port, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 2 and "--port" in err and "Traceback" not in err


def test_a_port_in_use_says_which_and_what_to_do(run, capsys, monkeypatch):
    """Item 12: 'Address already in use ()'."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        code, out, err, _ = serve_cli(run, "--port", str(port), capsys=capsys, monkeypatch=monkeypatch)
    finally:
        taken.close()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert str(port) in err and "--port" in err and "in use" in err and "()" not in err


@pytest.mark.parametrize("content", ["", "{}", '{"graphs": []}', '{"graphs": 3}', "[1, 2]", '{"graphs": [{"x": 1}]}',
                                     "not json", '{"graphs": [{"slug": 5}]}'])
def test_an_empty_or_corrupt_index_is_one_line_naming_the_file(run, capsys, monkeypatch, content):
    """Item 11: an index with no graphs gave an IndexError, a corrupt one a TypeError."""
    index = run / "graphs" / "graph-metadata.json"
    index.write_text(content)
    code, out, err, _ = serve_cli(run, "--port", "0", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(index) in err, err
    # building a graph adds to it: refused before any work (this run has no model to load)
    if content.strip() != '{"graphs": []}':
        assert main(["graph", "--out", str(run), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert str(index) in err and "model" not in err, err
    # the explorer reads the same index
    code = main(["explore", "--out", str(run)])
    err = capsys.readouterr().err
    if content.strip() in ('{"graphs": []}',):
        assert code == 0
    else:
        assert code == 2 and str(index) in err and "Traceback" not in err


def test_out_naming_a_file_is_a_clear_error(tmp_path, capsys):
    """Item 15: '[Errno 17] File exists'."""
    file = tmp_path / "a-file"
    file.write_text("x")
    for argv in (["graph", "--out", str(file), "--serve"], ["graph", "--out", str(file), "--prompt", "hi"],
                 ["explore", "--out", str(file)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--out" in err and str(file) in err and "is a file" in err and "Errno" not in err, err


def test_the_explorers_graph_links_work_on_the_server_that_serves_it(run):
    """Item 15: the explorer linked the viewer at port 8032 whatever port served it. Its links are
    relative now, and both serve commands serve them."""
    from pipelines.explorer.data import meta_bundle
    from pipelines.explorer.site import make_server

    meta = meta_bundle(RunPaths(run), type("T", (), {"get": lambda self, n: None, "frames": {}, "missing": {}})(),
                       [], [], {})
    (link,) = meta["graphs"]
    assert "8032" not in link["viewer"] and not link["viewer"].startswith(("/", "http"))
    for server in (make_server(run / "explorer", port=0), graph_server(RunPaths(run), 0)):
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert request(server, "/" + link["viewer"])[0] == 200
            assert request(server, "/graphs/g.json")[0] == 200  # the explorer's `../graphs/<slug>.json`
        finally:
            server.shutdown()
            server.server_close()


def test_part_names_of_valued_outputs_read_and_stay_unique():
    """Issue 51, item 22: `logit:`/`file:` output sets got parts named by a hash only."""
    from pipelines.inputs import part_name

    names = [part_name("resid_mid", spec, "encoder") for spec in
             ("logit:happy-sad", "logit:Happy-Sad", "logit:happy sad", "file:/a/dirs.npy", "file:/b/dirs.npy")]
    assert names[0].startswith("resid_mid-logit-happy-sad-") and "dirs-npy" in names[3]
    assert len(set(names)) == len(names) and part_name("resid_mid", "sae", "encoder") == "resid_mid-sae"


def test_attacks_from_a_page_fail_in_a_browser(served, run):
    """Items 1 and 2 in Chromium: the viewer's page loads, while what a page can send (paths with
    `//`, `..` and encoded traversal, a symlink, a form-like POST with `text/plain`, which needs
    no CORS preflight) reads or writes nothing, and a name rebound to 127.0.0.1 gets no page."""
    from tests.test_explorer import CHROMIUM_ARGS, chromium_path

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    if chromium_path() is None:
        pytest.skip("needs Debian's chromium")
    port = served.server_address[1]
    before = (run / "graphs" / "g.json").read_bytes(), (run / "graphs" / "graph-metadata.json").read_bytes()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True,
                                    args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"])
        page = browser.new_page()
        page.route(lambda url: "127.0.0.1" not in url and "rebind.test" not in url, lambda route: route.abort())
        assert page.goto(f"http://127.0.0.1:{port}/viewer/index.html").status == 200
        got = page.evaluate("""async () => {
            const out = {}
            for (const path of ['/viewer/data//etc/passwd', '/viewer/data/../../lm/config.json',
                                '/viewer/data/%2e%2e/%2e%2e/lm/config.json', '/viewer/data/..%2f..%2flm%2fconfig.json',
                                '/viewer/data/link.json', '/graphs/lm/config.json', '/viewer/data/features/']) {
                const r = await fetch(path)
                out[path] = [r.status, await r.text()]
            }
            for (const path of ['/save_graph/g', '/viewer/save_graph/g', '/save_graph/graph-metadata']) {
                const r = await fetch(path, {method: 'POST', headers: {'Content-Type': 'text/plain'},
                                             body: JSON.stringify({qParams: {pinnedIds: ['x']}, graphs: []})})
                out['POST ' + path] = [r.status, '']
            }
            return out
        }""")
        rebound = page.goto(f"http://rebind.test:{port}/viewer/data/g.json")
        rebound_status, rebound_body = rebound.status, rebound.text()
        browser.close()
    for path, (status, body) in got.items():
        assert status >= 400 and SECRET not in body and "root:" not in body, (path, status)
    assert rebound_status == 421 and '"nodes"' not in rebound_body
    assert ((run / "graphs" / "g.json").read_bytes(), (run / "graphs" / "graph-metadata.json").read_bytes()) == before
