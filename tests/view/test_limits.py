"""The viewer beside heavy queries and beside `catalog merge` (view/store.py, catalog/db.py).

- a query spills only to ROOT/view-cache/duckdb-tmp/, up to its limit (never beside the catalog);
- pages of user SQL run a bounded number at once (more: 503 with Retry-After), a plain page answers
  while they run, and a query whose client left is interrupted (its slot free long before its time);
- a merge waits for a viewer that is about to let go, pages answer 503 while it holds the catalog and
  a known clip's video keeps playing; a merge that gives up names the viewer that holds the file.

The viewers are the real command (uvicorn) over a copy of the suite's ingested root.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from support import REPO, quiet_env, sql

from reelcache import UserError
from reelcache.catalog.db import open_catalog
from reelcache.view.server import build_app

HEAVY = "(SELECT count(*) FROM range(1000000000000) t(x) WHERE x % 7 = 3) > 0"  # minutes, in no memory


@contextlib.contextmanager
def _viewer(root: Path, *args: str):
    p = subprocess.Popen(
        [sys.executable, "-m", "reelcache", "view", "--root", str(root), "--port", "0", *args],
        cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line + (p.stdout.read() if p.poll() is not None else "")
        yield int(m[1])
    finally:
        p.terminate()
        p.wait(timeout=30)


def _get(port: int, path: str) -> tuple[int, object, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=120) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _send(port: int, path: str) -> socket.socket:
    """A request whose answer is left unread (the client can then leave)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    return s


def _until(fn, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s: {what}")


def test_a_query_spills_only_into_view_cache_and_only_so_much(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    open_catalog(root, write=True).close()
    c = TestClient(build_app(root, memory="32MB", spill="1MB"), base_url="http://127.0.0.1")
    try:
        r = c.get("/clips", params={"where": "(SELECT count(DISTINCT x) FROM range(6000000) t(x)) > 0"})
        assert (root / "view-cache" / "duckdb-tmp").is_dir()
    finally:
        c.app.state.store.close()
    assert r.status_code == 400 and "max_temp_directory_size" in r.text, r.text[-600:]
    assert sorted(p.name for p in root.iterdir()) == ["catalog.duckdb", "view-cache"]


def test_a_viewer_started_while_a_writer_waits_says_so_in_one_line(tmp_path, monkeypatch):
    """A viewer started while a merge holds or waits for the catalog waits a while for it, then one
    UserError naming the writer (it was a Busy traceback from Store.__init__)."""
    import os

    from reelcache.view import store

    root = tmp_path / "root"
    root.mkdir()
    open_catalog(root, write=True).close()
    # what a waiting writer writes (catalog/db.py): "pid host", this live process on this machine
    (root / "catalog.duckdb.writer").write_text(f"{os.getpid()} {socket.gethostname()}\n")
    monkeypatch.setattr(store, "START_WAIT_S", 0.5)
    with pytest.raises(UserError, match=rf"being written \(process {os.getpid()} on .* waits to write it\).*waited"):
        build_app(root)


@pytest.mark.slow
def test_user_queries_are_bounded_and_a_plain_page_answers_while_they_run(fresh_root):
    heavy = "/clips?where=" + urllib.parse.quote(HEAVY)
    with _viewer(fresh_root, "--queries", "2", "--query-seconds", "120") as port:
        with ThreadPoolExecutor(10) as pool:  # a burst of light grid pages: they wait their turn, none refused
            assert list(pool.map(lambda _: _get(port, "/clips?where=true")[0], range(10))) == [200] * 10
        running = [_send(port, heavy), _send(port, heavy)]
        # a third finds both slots taken (once the two have started): 503 at once, with Retry-After
        status, headers, body = _until(
            lambda: (r := _get(port, heavy))[0] == 503 and r, 60, "a third heavy page refused"
        )
        assert int(headers["Retry-After"]) > 0 and len(body.decode().strip().splitlines()) == 1, body
        t0 = time.monotonic()
        status, _, body = _get(port, "/rejects")
        plain_s = time.monotonic() - t0
        assert status == 200 and b"Rejects" in body
        ready, _, _ = select.select(running, [], [], 0)
        assert not ready, "the heavy pages ended before the plain page was answered"
        print(f"/rejects answered in {plain_s:.3f} s beside two heavy queries")
        for s in running:  # their clients leave: the queries are interrupted, the slots free at once
            s.close()
        t0 = time.monotonic()
        _until(lambda: _get(port, "/clips?where=true")[0] == 200, 30, "a slot free after the clients left")
        print(f"a slot was free {time.monotonic() - t0:.3f} s after the heavy clients left")


@pytest.mark.slow
def test_a_merge_waits_for_the_viewer_which_answers_503_and_keeps_playing(fresh_root, monkeypatch):
    import reelcache.catalog.db as db

    clip_id, path = sql(fresh_root, "SELECT clip_id, path FROM clips WHERE status = 'ok' ORDER BY 1 LIMIT 1")[0]
    with _viewer(fresh_root, "--queries", "1", "--query-seconds", "120") as port:
        assert _get(port, f"/clip?id={clip_id}")[0] == 200  # the viewer now knows the clip's shard
        assert _get(port, "/rejects")[0] == 200  # and has the catalog open
        con = open_catalog(fresh_root, write=True)  # what merge does: it waits for the viewer to let go
        try:
            status, headers, body = _get(port, "/rejects")
            assert status == 503 and int(headers["Retry-After"]) > 0, (status, body[:300])
            assert b"being written" in body and len(body.decode().strip().splitlines()) == 1, body
            status, _, video = _get(port, f"/media/raw?id={clip_id}")
            assert status == 200 and video == Path(path).read_bytes()  # the input file's bytes, still served
        finally:
            con.close()
        assert _get(port, "/rejects")[0] == 200

        # a viewer busy with a long query does not let go: the merge waits a while, then names it. (A long
        # page that had not yet opened its cursor steps aside as any page does, answering 503: then again.)
        monkeypatch.setattr(db, "WRITE_WAIT_S", 1.0)
        said = None
        for _ in range(5):
            heavy = _send(port, "/clips?where=" + urllib.parse.quote(HEAVY))
            _until(lambda: _get(port, "/clips?where=true")[0] == 503, 30, "the long query running (its slot taken)")
            try:
                open_catalog(fresh_root, write=True).close()
            except UserError as e:
                said = str(e)
                break
            finally:
                heavy.close()
        assert said and re.search(r"busy after waiting [\d.]+ s: process \d+ \(reelcache view --root", said), said
