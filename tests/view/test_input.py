"""`reelcache view` without a browser: a bad URL is one line with a 4xx status, never a 500; only a
loopback address serves without a warning.

The app is Starlette's own, driven in-process by its TestClient over a catalog made by
catalog/db.py (empty tables) and a run directory that never started (no config.json).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
from starlette.testclient import TestClient  # needs httpx (pyproject's dev extra)

from reelcache.catalog.db import open_catalog
from reelcache.view.server import build_app

BASE = "http://127.0.0.1:8050"  # a Host the viewer listens as (TestClient's own 'testserver' is refused)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewroot")
    open_catalog(root, write=True).close()
    (root / "runs" / "never-started" / "log").mkdir(parents=True)
    c = TestClient(build_app(root), base_url=BASE, raise_server_exceptions=False)
    yield c
    _close(c)


def _close(client) -> None:
    """Close the viewer's catalog connection now: its idle timer (a daemon thread) then has nothing to
    close, rather than closing it in DuckDB while the interpreter exits (an abort at the end of the run)."""
    client.app.state.store.close()


@pytest.mark.parametrize(
    ("url", "status", "says"),
    [
        ("/stage?name=nosuch", 404, "no run 'nosuch' with a config.json"),
        ("/stage?name=never-started", 404, "no run 'never-started' with a config.json"),
        ("/stage?name=..", 403, "climbs out with '..'"),
        ("/run?name=nosuch", 403, "no run 'nosuch'"),
        ("/step?name=nosuch&step=x", 400, "expected a step number"),
        ("/clip?id=nosuch", 404, "no clip 'nosuch' in the catalog"),
        ("/files/..%2Fcatalog.duckdb", 403, "climbs out with '..'"),
    ],
)
def test_a_bad_url_is_one_line_with_a_4xx_status(client, url, status, says):
    r = client.get(url)
    assert (r.status_code, says in r.text) == (status, True), r.text[:300]
    assert len(r.text.strip().splitlines()) == 1


def _write_open(root) -> str:
    """Open the catalog for writing in another process, as `catalog merge` does: '' or its one-line error."""
    code = "import sys; from reelcache.catalog.db import open_catalog; open_catalog(sys.argv[1], write=True).close()"
    p = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120)
    return "" if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.slow
def test_a_running_viewer_lets_a_merge_write_the_catalog_between_requests(client):
    """DuckDB lets a process write the file only while no other process has it open: the viewer keeps it
    open only while it answers (closed IDLE_S after the last request), so a merge is not refused for as
    long as a viewer runs. Reference: another process opening the catalog for writing (what merge does)."""
    root = client.app.state.root
    assert client.get("/clips").status_code == 200
    deadline, said = time.monotonic() + 60, "?"
    while said and time.monotonic() < deadline:  # a liveness wait, not a speed bound
        said = _write_open(root)
        time.sleep(0.5)
    assert said == "", said
    assert client.get("/clips").status_code == 200  # opened again by the next request


def test_a_rejects_play_error_is_data_not_script(tmp_path):
    """The reject page's <video> says why it does not play through data-* attributes read by the static
    script (no inline handler: the CSP runs none), the reason one whole attribute value.
    Reference: Python's own HTML parser."""
    from html.parser import HTMLParser

    from reelcache.catalog.db import clips_table

    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (root / "in/bad.mp4").write_bytes(b"not a video")
    row = dict(clip_id="r1", source="demo", unit="demo/000000", row=0, path=str(root / "in/bad.mp4"),
               text="x", status="rejected", reject_reason="undecodable", codec="h264")  # fmt: skip
    con = open_catalog(root, write=True)
    try:
        con.register("new_clips", clips_table([row]))
        con.execute("INSERT INTO clips BY NAME SELECT * FROM new_clips")
    finally:
        con.close()
    c = TestClient(build_app(root), base_url=BASE)
    page = c.get("/reject?id=r1")
    _close(c)
    assert page.status_code == 200, page.text[:300]

    videos = []

    class Videos(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "video":
                videos.append(dict(attrs))

    Videos().feed(page.text)
    (video,) = videos
    assert set(video) == {"id", "controls", "preload", "src", "data-error-in", "data-error-text"}, video
    assert video["data-error-in"] == "play-error"
    assert video["data-error-text"].endswith("(the file is rejected: undecodable)"), video["data-error-text"]


def test_a_request_waits_for_the_name_lookups_own_connection(client):
    """catalog/manifest.py's name lookup opens the catalog read-only with DuckDB's default configuration for
    a moment (a Stage page's loader does it); while it is open DuckDB refuses the viewer's connection (another
    configuration in the same process). A request arriving then waits for it, instead of a 500."""
    import threading

    import duckdb

    from reelcache.catalog.db import db_path

    store = client.app.state.store
    store.close()  # as after IDLE_S without a request
    other = duckdb.connect(str(db_path(client.app.state.root)), read_only=True)
    threading.Timer(0.5, other.close).start()
    r = client.get("/clips")
    assert r.status_code == 200, r.text[:300]


def test_a_thumbnail_reads_no_shard_outside_the_root(tmp_path):
    """A catalog row whose raw shard lies outside ROOT (a '..' path, a symlink out): the raw video is refused,
    and so is its thumbnail, which would otherwise decode that file (both 403, nothing made)."""
    from reelcache.catalog.db import clips_table

    root = tmp_path / "root"
    (root / "raw").mkdir(parents=True)
    (tmp_path / "outside.tar").write_bytes(b"\0" * 1024)
    (root / "raw" / "link.tar").symlink_to(tmp_path / "outside.tar")
    rows = [dict(clip_id=f"o{i}", source="demo", unit="demo/000000", row=i, path="x.mp4", text="x", status="ok",
                 shard=shard, shard_offset=0, file_size=512, ext="mp4", codec="h264")
            for i, shard in enumerate(["../outside.tar", "raw/link.tar"])]  # fmt: skip
    con = open_catalog(root, write=True)
    try:
        con.register("new_clips", clips_table(rows))
        con.execute("INSERT INTO clips BY NAME SELECT * FROM new_clips")
    finally:
        con.close()
    c = TestClient(build_app(root), base_url=BASE, raise_server_exceptions=False)
    try:
        for clip in ("o0", "o1"):
            for media in ("raw", "thumb"):
                r = c.get(f"/media/{media}?id={clip}")
                assert (r.status_code, r.text.startswith("refused:")) == (403, True), (clip, media, r.text[:200])
    finally:
        _close(c)
    assert not (root / "view-cache" / "thumbs").exists()  # no thumbnail made


def test_only_loopback_addresses_go_without_a_token():
    from reelcache.view.guard import loopback

    assert all(loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "head-node"))


def test_the_loss_curve_marks_a_resume_and_has_round_ticks():
    """A run killed after step 6 and resumed (generation 1 from step 5 on): one mark where generation 1's
    steps begin, ticks at round values inside the axes, losses shown to 4 significant digits."""
    from reelcache.view.pages import loss_svg

    losses = [{"step": s, "loss": 1 / (s + 1) + 0.123456789, "skipped": False, "generation": int(s >= 5)}
              for s in range(12)]  # fmt: skip
    svg = loss_svg("r", losses, set())
    assert [r["step"] for r in svg["resumes"]] == [5] and svg["resumes"][0]["generation"] == 1
    assert [label for _, label in svg["xticks"]] == [0, 5, 10]  # steps 0..11: about 5 ticks of 1, 2 or 5 x 10^k
    values = [float(label) for _, label in svg["yticks"]]
    lo, hi = min(r["loss"] for r in losses), max(r["loss"] for r in losses)
    assert len(values) >= 3 and all(lo <= v <= hi for v in values)
    step = values[1] - values[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - k) < 1e-9 for k in (1, 2, 5)), step
    assert all(abs(v / step - round(v / step)) < 1e-6 for v in values)  # multiples of the step
    assert {p[3] for p in svg["points"]} == {f"{r['loss']:.4g}" for r in losses}
