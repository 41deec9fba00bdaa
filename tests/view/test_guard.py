"""What every request to `reelcache view` passes (view/guard.py), over plain HTTP: the Host check against DNS
rebinding, the token beyond loopback, the security headers, files from the data never active on the
viewer's origin, a page number out of range a 400.

In-process through Starlette's TestClient over a catalog made by catalog/db.py; the token printed by a
viewer listening on every interface, and its stop while a download stalls, with the real command.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys

import pytest
from starlette.testclient import TestClient
from support import REPO, quiet_env

from reelcache.catalog.db import open_catalog
from reelcache.view.server import build_app

BASE = "http://127.0.0.1:8050"
TOKEN = "t0ken-of-this-test-abcdef"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("guardroot")
    open_catalog(root, write=True).close()
    (root / "stats").mkdir()
    (root / "stats" / "page.html").write_text("<script>alert(origin)</script>")
    (root / "stats" / "pic.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" onload="alert(origin)"/>')
    (root / "stats" / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / "stats" / "notes.txt").write_text("<b>just text</b>")
    return root


@pytest.fixture(scope="module")
def client(root):
    c = TestClient(build_app(root), base_url=BASE, raise_server_exceptions=False)
    yield c
    c.app.state.store.close()


@pytest.fixture(scope="module")
def locked(root):
    c = TestClient(build_app(root, token=TOKEN), base_url=BASE, raise_server_exceptions=False, follow_redirects=False)
    yield c
    c.app.state.store.close()


@pytest.mark.parametrize("url", ["/", "/rejects", "/clips", "/files/stats/plot.png", "/static/view.js", "/nosuch"])
def test_every_response_carries_the_security_headers(client, url):
    r = client.get(url)
    csp = r.headers["content-security-policy"]
    directives = dict((d.split(" ", 1) + [""])[:2] for d in (x.strip() for x in csp.split(";")))
    assert directives["script-src"] == "'self'" and "unsafe" not in csp, csp
    assert directives["style-src"] == "'self'" and directives["default-src"] == "'none'", csp
    assert directives["frame-ancestors"] == "'none'", csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert ("sandbox" in directives) == url.startswith("/files/"), csp


@pytest.mark.parametrize(
    ("name", "kind", "attachment"),
    [("page.html", "application/octet-stream", True), ("pic.svg", "application/octet-stream", True),
     ("plot.png", "image/png", False), ("notes.txt", "text/plain; charset=utf-8", False)],
)  # fmt: skip
def test_a_file_under_the_root_is_never_active_content(client, root, name, kind, attachment):
    r = client.get(f"/files/stats/{name}")
    assert r.status_code == 200 and r.content == (root / "stats" / name).read_bytes()
    assert r.headers["content-type"] == kind
    assert r.headers.get("content-disposition", "").startswith("attachment") == attachment


@pytest.mark.parametrize("host", ["attacker.example:8050", "attacker.example", "127.0.0.1.attacker.example", ""])
def test_a_host_the_viewer_does_not_listen_as_is_refused(client, host):
    """DNS rebinding: a page of attacker.example, its name re-pointed at 127.0.0.1, sends its own Host."""
    r = client.get("/files/catalog.duckdb", headers={"host": host})
    assert r.status_code == 403 and "is not a name this viewer listens as" in r.text, r.text[:200]
    assert len(r.text.strip().splitlines()) == 1


@pytest.mark.parametrize("host", ["127.0.0.1:8050", "localhost:8050", "[::1]:8050", "10.1.2.3:8050", "LOCALHOST"])
def test_loopback_names_and_addresses_are_served(client, host):
    assert client.get("/rejects", headers={"host": host}).status_code == 200


def test_the_names_of_a_viewer_on_every_interface():
    from reelcache.view.guard import host_allowed, host_names

    names = host_names("0.0.0.0", ["viewer.lab.example"])
    assert host_allowed(f"{socket.gethostname()}:8050", names) and host_allowed("viewer.lab.example.", names)
    assert not host_allowed("attacker.example", names)
    assert not host_allowed("attacker.example", host_names("127.0.0.1"))


def test_a_token_is_needed_on_every_request_and_becomes_a_cookie(locked):
    for url in ("/", "/rejects", "/files/stats/plot.png", "/media/raw?id=x", "/static/view.js"):
        r = locked.get(url)
        assert r.status_code == 403 and "needs its token" in r.text, (url, r.status_code)
    assert locked.get("/rejects?token=wrong-token-of-the-same-length").status_code == 403
    r = locked.get(f"/rejects?reason=x&token={TOKEN}")
    assert r.status_code == 303 and r.headers["location"] == "/rejects?reason=x"  # the token out of the URL
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
    assert locked.get("/rejects?reason=x").status_code == 200  # the client keeps the cookie
    r = locked.get(f"/files/stats/it%27s%20%231.txt?token={TOKEN}")
    assert r.headers["location"] == "/files/stats/it%27s%20%231.txt"  # the path as sent: '#' stays in the path
    locked.cookies.clear()
    assert locked.get("/rejects").status_code == 403
    assert locked.get("/rejects", headers={"authorization": f"token {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("url", ["/rejects?page=99999999999999999999999", "/clips?page=-1", "/rejects?page=x"])
def test_a_page_out_of_range_is_a_400(client, url):
    r = client.get(url)
    assert r.status_code == 400 and "expected a number from 0 to" in r.text, r.text[:200]
    assert len(r.text.strip().splitlines()) == 1


def test_a_bad_token_is_one_line(root):
    p = subprocess.run(
        [sys.executable, "-m", "reelcache", "view", "--root", str(root), "--port", "0", "--token", "a b"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2 and "--token" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_beyond_loopback_the_printed_url_carries_a_token_and_sigterm_ends_a_stalled_download(root):
    """--host 0.0.0.0 with no token: one is made and printed in the URL; 127.0.0.1 without it is refused.
    A client that stops reading a large file does not keep a SIGTERM from ending the viewer."""
    big = root / "stats" / "big.bin"
    with open(big, "wb") as f:
        f.truncate(256 << 20)  # sparse: more than every socket buffer on the way holds
    p = subprocess.Popen(
        [sys.executable, "-m", "reelcache", "view", "--root", str(root), "--port", "0", "--host", "0.0.0.0"],
        cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out = ""
        while "http://" not in out and p.poll() is None:
            out += p.stdout.readline()
        m = re.search(r"http://\S+:(\d+)/\?token=([A-Za-z0-9_-]+)", out)
        assert m, out
        port, token = m[1], m[2]
        with socket.create_connection(("127.0.0.1", int(port))) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            assert s.recv(100).startswith(b"HTTP/1.1 403")
        stalled = socket.create_connection(("127.0.0.1", int(port)))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(
            f"GET /files/stats/big.bin HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: token {token}\r\n\r\n".encode()
        )
        assert stalled.recv(12) == b"HTTP/1.1 200"  # the download started; nothing more is read
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) is not None  # without the graceful-shutdown bound: never, while it stalls
        stalled.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        big.unlink()
