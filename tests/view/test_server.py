"""`reelcache view` in Debian's headless Chromium (Selenium with /usr/bin/chromedriver, never a download).

The demo root is the suite's ingested fixture plus a tiny two-view cache of 6 clips and a 3-step
training run on one process: every page opens, a reject leads to its input file, a clip's raw video
(ranges of its shard) and a view's decoded latent play to HAVE_ENOUGH_DATA with the window's
duration, the step page lists the consumed log's clips (joined here with pyarrow), and traversal
and write statements are refused with the catalog and every file outside view-cache/ unchanged.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import REPO, quiet_env, tiny_cache_config

pytestmark = pytest.mark.browser

HAVE_ENOUGH_DATA = 4


def _main(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "reelcache", *args], cwd=REPO, env=quiet_env(), capture_output=True, text=True
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def demo_root(ingested, tmp_path_factory) -> Path:
    """The ingested root + manifest m (6 ok clips) + cache t (tiny LTX, 2 views) + manifest lat + run r (3 steps)."""
    root = tmp_path_factory.mktemp("view") / "root"
    shutil.copytree(ingested, root)
    six = "clip_id IN (SELECT clip_id FROM clips WHERE status = 'ok' AND codec = 'h264' ORDER BY clip_id LIMIT 6)"
    _main("catalog", "manifest", "--root", str(root), "--name", "m", "--where", six)
    cfg = tiny_cache_config(root / "cache.toml", "m")
    units = _main("cache", "plan", "--root", str(root), "--config", str(cfg)).split()
    _main("cache", "run", "--root", str(root), "--device", "cpu", *units)
    _main("catalog", "merge", "--root", str(root))
    _main("catalog", "manifest", "--root", str(root), "--name", "lat", "--cache", "t")
    _main("catalog", "stats", "--root", str(root))
    p = subprocess.run(
        [sys.executable, "-m", "reelcache.train", "configs/train/debug/stage1.toml", "--root", str(root),
         "--run.name=r", '--data.manifests=[{name="lat"}]', "--run.max_steps=3", "--run.epochs=2",
         "--data.workers=0", "--log.wandb_mode=disabled", "--log.every=1", "--checkpoint.every=3"],
        cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    # an eval sample whose name holds a quote, a space and a '#' (a URL's fragment, unless encoded)
    (h264,) = _sql(root, "SELECT path FROM clips WHERE status = 'ok' AND codec = 'h264' AND ext = 'mp4' LIMIT 1")[0]
    sample = root / "runs" / "r" / "eval" / "ckpt-000003" / "samples" / 'it\'s #1 "a cat".mp4'
    sample.parent.mkdir(parents=True)
    shutil.copyfile(h264, sample)
    return root


def _snapshot(root: Path) -> dict[str, str]:
    """Every file outside view-cache/ with a hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.relative_to(root).parts[0] == "view-cache"
    }


@pytest.fixture(scope="module")
def server(demo_root, demo_dataset):
    before = _snapshot(demo_root)
    p = subprocess.Popen(
        [sys.executable, "-m", "reelcache", "view", "--root", str(demo_root), "--port", "0",
         "--videos", str(demo_dataset / "videos")],
        cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    line = p.stdout.readline()
    m = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
    assert m, line + (p.stdout.read() if p.poll() is not None else "")
    yield m[1]
    p.terminate()
    p.wait(timeout=20)
    assert _snapshot(demo_root) == before  # nothing written outside view-cache/, the catalog included


def _shot(driver, tmp_path: Path, name: str) -> None:
    """A screenshot once every image of the page has loaded (thumbnails are made on their first request)."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 60, 0.2).until(
        lambda d: d.execute_script("return [...document.images].every(i => i.loading === 'lazy' && "
                                   "i.getBoundingClientRect().top > innerHeight || i.complete && i.naturalWidth > 0)")
    )  # fmt: skip
    assert driver.save_screenshot(str(tmp_path / f"{name}.png"))


def _video(driver, el, timeout: float = 120.0) -> tuple[int, float]:
    """(readyState, duration) once the element has enough data to play through (or the timeout)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script("arguments[0].play().catch(() => {})", el)
    # read in the same script that saw it: a short clip that then plays to its end drops back to
    # HAVE_CURRENT_DATA (2), as CI saw once between two scripts
    state, duration, err = WebDriverWait(driver, timeout, 0.2).until(
        lambda d: d.execute_script(
            "const v = arguments[0]; return (v.readyState >= 4 || v.error !== null) && "
            "[v.readyState, v.duration, v.error && v.error.code]",
            el,
        )
    )
    assert err is None, f"media error {err} for {el.get_attribute('src')}"
    return state, duration


def _sql(root: Path, q: str, params=None):
    import duckdb

    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(q, params or []).fetchall()
    finally:
        con.close()


def test_every_page_opens_and_shows_the_catalog(server, browser, demo_root, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server + "/")
    _shot(browser, tmp_path, "overview")
    text = browser.find_element(By.TAG_NAME, "body").text
    for source, rows, ok, rejected in _sql(demo_root, "SELECT source, count(*), count(*) FILTER (status = 'ok'), "
                                           "count(*) FILTER (status = 'rejected') FROM clips GROUP BY 1"):  # fmt: skip
        assert f"{source} {rows} {ok} {rejected}" in text
    assert browser.find_elements(By.CSS_SELECTOR, "img[src='/files/stats/catalog.png']")
    assert {a.text for a in browser.find_elements(By.CSS_SELECTOR, "a.manifest")} == {"m", "lat"}
    assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "a.run")] == ["r"]

    # Clips: the grid of a WHERE clause, with its counts per level from the catalog
    where = "status = 'ok' AND level <= 3"
    browser.get(server + "/clips?where=" + urllib.request.quote(where))
    _shot(browser, tmp_path, "clips")
    want = sorted(c for (c,) in _sql(demo_root, f"SELECT clip_id FROM clips WHERE {where}"))
    got = sorted(a.get_attribute("data-clip-id") for a in browser.find_elements(By.CSS_SELECTOR, "#grid .clip-card"))
    assert got == want
    levels = dict(_sql(demo_root, f"SELECT level, count(*) FROM clips WHERE {where} GROUP BY 1"))
    rows = browser.find_elements(By.CSS_SELECTOR, "table.count-level tr")[1:]
    assert {int(r.text.split()[0]): int(r.text.split()[1]) for r in rows} == levels

    # Manifest and stage (the loader's plan per epoch): every sample of each epoch counted once
    browser.get(server + "/manifest?name=lat")
    assert "per bucket" in browser.find_element(By.TAG_NAME, "body").text
    browser.get(server + "/run?name=r")
    _shot(browser, tmp_path, "run")
    assert browser.find_elements(By.CSS_SELECTOR, "svg#loss polyline")
    browser.find_element(By.ID, "stage").click()
    _shot(browser, tmp_path, "stage")
    (n_lat,) = _sql(demo_root, "SELECT count(DISTINCT clip_id) FROM latents WHERE cache = 't' AND status = 'ok'")[0]
    epochs = browser.find_elements(By.CSS_SELECTOR, "section.epoch")
    assert len(epochs) == 2
    for e in epochs:
        source_rows = e.find_elements(By.CSS_SELECTOR, "table.count-source tr")[1:]
        assert sum(int(r.text.split()[-1]) for r in source_rows) == n_lat  # one view of each clip per epoch


def test_a_reject_leads_to_its_input_file(server, browser, demo_root, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server + "/rejects")
    _shot(browser, tmp_path, "rejects")
    (total,) = _sql(demo_root, "SELECT count(*) FROM clips WHERE status = 'rejected'")[0]
    assert f"Rejects ({total})" in browser.find_element(By.TAG_NAME, "h1").text
    # a file that exists but was rejected (a video cut in half): its page links the bytes of the input
    (clip_id, path) = _sql(
        demo_root,
        "SELECT clip_id, path FROM clips WHERE status = 'rejected' AND reject_reason = 'truncated' ORDER BY 1 LIMIT 1",
    )[0]
    link = next(a for a in browser.find_elements(By.CSS_SELECTOR, "a.reject") if clip_id in a.get_attribute("href"))
    link.click()
    _shot(browser, tmp_path, "reject")
    assert browser.find_element(By.ID, "input-path").text == path
    href = browser.find_element(By.ID, "input-file").get_attribute("href")
    with urllib.request.urlopen(href) as r:
        assert r.read() == Path(path).read_bytes()
    video = browser.find_element(By.ID, "input-video")  # it may or may not play: the page says which
    browser.execute_script("arguments[0].load()", video)
    deadline = time.monotonic() + 30  # until Chromium has read its header, or given up on it
    while not browser.execute_script("return arguments[0].readyState >= 1 || arguments[0].error !== null", video):
        assert time.monotonic() < deadline, "the input video neither loaded nor failed"
        time.sleep(0.02)
    code = browser.execute_script("return arguments[0].error && arguments[0].error.code", video)
    if code is not None:  # the page's error handler says why, once the error event has run
        while "cannot play" not in browser.find_element(By.ID, "play-error").text:
            assert time.monotonic() < deadline, "the page did not say why the input cannot play"
            time.sleep(0.02)


def test_a_clip_and_its_views_play(server, browser, demo_root, tmp_path):
    from selenium.webdriver.common.by import By

    clip_id, num_frames, fps = _sql(
        demo_root,
        "SELECT l.clip_id, any_value(c.num_frames), any_value(c.fps) FROM latents l JOIN clips c USING (clip_id) "
        "WHERE l.cache = 't' AND l.status = 'ok' GROUP BY 1 HAVING count(*) = 2 ORDER BY 1 LIMIT 1",
    )[0]
    browser.get(server + "/clip?id=" + urllib.request.quote(clip_id))
    raw = browser.find_element(By.ID, "raw")
    state, duration = _video(browser, raw)
    assert state == HAVE_ENOUGH_DATA
    assert duration == pytest.approx(num_frames / fps, abs=1.5 / fps)
    views = _sql(
        demo_root,
        "SELECT view, num_frames, window_start FROM latents WHERE cache = 't' AND clip_id = ? AND status = 'ok' "
        "ORDER BY view",
        [clip_id],
    )
    blocks = browser.find_elements(By.CSS_SELECTOR, "div.view")
    assert [int(b.get_attribute("data-view")) for b in blocks] == [v for v, *_ in views]
    for block, (_view, frames, start) in zip(blocks, views):
        assert f"window from frame {start}" in block.text
        for which in ("window", "latent"):
            state, duration = _video(browser, block.find_element(By.CSS_SELECTOR, f"video.{which}"))
            assert state == HAVE_ENOUGH_DATA
            assert duration == pytest.approx(frames / fps, abs=1.5 / fps)  # frame_interval 1 (demo buckets)
    _shot(browser, tmp_path, "clip")
    browser.execute_script("arguments[0].scrollIntoView()", blocks[0])
    _shot(browser, tmp_path, "clip-views")
    # made once, then served from the view cache
    made = sorted((demo_root / "view-cache" / "latent" / "t").glob("*.mp4"))
    assert len(made) == len(views)
    mtimes = [p.stat().st_mtime_ns for p in made]
    browser.refresh()
    _video(browser, browser.find_elements(By.CSS_SELECTOR, "video.latent")[0])
    assert [p.stat().st_mtime_ns for p in made] == mtimes


def test_the_step_page_lists_the_clips_of_the_consumed_log(server, browser, demo_root, tmp_path):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from selenium.webdriver.common.by import By

    run = demo_root / "runs" / "r"
    metrics = pq.ParquetDataset(sorted(str(p) for p in (run / "metrics").glob("*.parquet"))).read()
    consumed = pq.ParquetDataset(sorted(str(p) for p in (run / "consumed").glob("*.parquet"))).read()
    steps = sorted(set(metrics["step"].to_pylist()))
    assert len(steps) == 3
    for step in steps:
        rows = [r for r in metrics.to_pylist() if r["step"] == step]
        m = max(rows, key=lambda r: r["generation"])
        mask = pc.and_(
            pc.and_(pc.equal(consumed["generation"], m["generation"]), pc.equal(consumed["epoch"], m["epoch"])),
            pc.and_(pc.equal(consumed["step"], m["epoch_step"]), pc.invert(consumed["pad"])),
        )
        want = sorted(consumed.filter(mask)["clip_id"].to_pylist())
        assert want
        browser.get(f"{server}/step?name=r&step={step}")
        cards = browser.find_elements(By.CSS_SELECTOR, "#grid .clip-card")
        assert sorted(c.get_attribute("data-clip-id") for c in cards) == want
    _shot(browser, tmp_path, "step")
    cards[0].click()
    assert browser.find_element(By.TAG_NAME, "h1").text == f"Clip {want[0]}" or "Clip " in browser.title


def _status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_traversal_and_writes_are_refused_and_nothing_changes(server, browser, demo_root, tmp_path):
    from selenium.webdriver.common.by import By

    digest = hashlib.sha256((demo_root / "catalog.duckdb").read_bytes()).hexdigest()
    (n,) = _sql(demo_root, "SELECT count(*) FROM clips")[0]
    outside = demo_root.parent / "secret.txt"
    outside.write_text("not yours")
    link = demo_root / "stats" / "out.txt"
    link.symlink_to(outside)
    try:
        assert _status(server + "/files/stats/catalog.png")[0] == 200
        for path in ("/files/../secret.txt", "/files/stats/../../secret.txt", "/files/%2e%2e/secret.txt",
                     f"/files/{outside}", "/files//etc/passwd", "/files/stats/out.txt"):  # fmt: skip
            code, body = _status(server + path)
            assert code == 403 and "refused" in body and "not yours" not in body, (path, code, body)
    finally:
        link.unlink()
    for where in (
        "true; DROP TABLE clips",
        "true); DELETE FROM clips; SELECT (1",
        "clip_id IN (SELECT content FROM read_text('/etc/hostname'))",
        "(SELECT count(*) FROM read_csv('" + str(outside) + "')) > 0",
        "no_such_column > 3",
    ):
        browser.get(server + "/clips?where=" + urllib.request.quote(where))
        err = browser.find_elements(By.ID, "error")
        assert err and "\n" not in err[0].text and "Traceback" not in browser.page_source, where
        assert not browser.find_elements(By.CSS_SELECTOR, "#grid .clip-card")
    _shot(browser, tmp_path, "refused")
    assert hashlib.sha256((demo_root / "catalog.duckdb").read_bytes()).hexdigest() == digest
    assert _sql(demo_root, "SELECT count(*) FROM clips")[0] == (n,)


def test_every_raw_clip_plays_or_its_page_says_why(server, browser, demo_root):
    """The demo mixes H.264 in MP4/MOV/MKV, VP9 WebM, AV1 MKV, HEVC MP4 and MPEG-4 AVI: a clip of each
    plays from its shard in this Chromium, with the duration ffprobe gives its file, or its page says in
    one line why it cannot."""
    from selenium.webdriver.common.by import By

    said = set()
    for clip_id, codec, ext, path in _sql(
        demo_root,
        "SELECT min(clip_id), codec, ext, arg_min(path, clip_id) FROM clips WHERE status = 'ok' "
        "GROUP BY ALL ORDER BY 2, 3",
    ):
        browser.get(server + "/clip?id=" + urllib.request.quote(clip_id))
        why = browser.find_elements(By.ID, "raw-why")
        if why:
            assert "\n" not in why[0].text and (codec in why[0].text or ext in why[0].text), why[0].text
            said.add((codec, ext))
            continue
        state, duration = _video(browser, browser.find_element(By.ID, "raw"))
        assert state == HAVE_ENOUGH_DATA, (codec, ext)
        probed = subprocess.run(
            ["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", path],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        assert duration == pytest.approx(float(probed), abs=0.05), (codec, ext)  # the container's duration
    assert said == {("hevc", "mp4"), ("mpeg4", "avi")}


def test_thumbnails_are_the_displayed_picture(server, demo_root, tmp_path):
    """A rotated and an anamorphic clip's thumbnails equal ffmpeg's first frame (autorotate, SAR) at their size."""
    import io

    import numpy as np
    from PIL import Image

    rows = _sql(
        demo_root, "SELECT clip_id, path FROM clips WHERE status = 'ok' AND (rotation <> 0 OR sar_num <> sar_den)"
    )
    assert len(rows) == 2
    for clip_id, path in rows:
        with urllib.request.urlopen(f"{server}/media/thumb?id={clip_id}") as r:
            thumb = np.asarray(Image.open(io.BytesIO(r.read())).convert("RGB"), dtype=float)
        h, w = thumb.shape[:2]
        ref = tmp_path / f"{clip_id}.png"
        subprocess.run(
            ["ffmpeg", "-v", "error", "-i", path, "-frames:v", "1", "-vf", f"scale={w}:{h}", str(ref)], check=True
        )
        assert np.abs(thumb - np.asarray(Image.open(ref).convert("RGB"), dtype=float)).mean() < 6.0


def test_facets_narrow_the_selection_and_it_becomes_a_manifest(server, browser, demo_root, tmp_path):
    """Each count is a link to the selection narrowed to it; the grid sorts; the pager is above and below;
    the `catalog manifest` command on the page, run on a copy of the root, makes a manifest of the size the
    page says (pyarrow reads it)."""
    import shlex

    import pyarrow.parquet as pq
    from selenium.webdriver.common.by import By

    where = "source = 'openvid'"  # rejects included
    browser.get(server + "/clips?where=" + urllib.request.quote(where))
    assert len(browser.find_elements(By.CSS_SELECTOR, "p.pager-top")) == 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "p.pager-bottom")) == 1
    link = next(a for a in browser.find_elements(By.CSS_SELECTOR, "table.count-status a") if a.text == "rejected")
    link.click()
    narrowed = f"({where}) AND status = 'rejected'"
    assert browser.find_element(By.ID, "where").get_attribute("value") == narrowed
    want = sorted(c for (c,) in _sql(demo_root, f"SELECT clip_id FROM clips WHERE {narrowed}"))
    cards = browser.find_elements(By.CSS_SELECTOR, "#grid .clip-card")
    assert sorted(c.get_attribute("data-clip-id") for c in cards) == want and want
    assert all("/reject?id=" in c.get_attribute("href") for c in cards)  # a reject's card leads to its reject page
    cards[0].click()
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Rejected:")

    # a bucket's clips, sorted by duration, longest first
    browser.get(server + "/clips?where=true")
    link = browser.find_elements(By.CSS_SELECTOR, "table.count-bucket a")[0]
    cache, bucket = link.text.split(" ", 1)
    link.click()
    browser.get(browser.current_url + "&sort=duration&desc=1")
    got = [c.get_attribute("data-clip-id") for c in browser.find_elements(By.CSS_SELECTOR, "#grid .clip-card")]
    want = [c for (c,) in _sql(demo_root, "SELECT clip_id FROM clips WHERE clip_id IN (SELECT clip_id FROM latents "
                               "WHERE cache = ? AND bucket = ? AND status = 'ok') ORDER BY duration DESC, clip_id",
                               [cache, bucket])]  # fmt: skip
    assert got == want and want

    # the selection as a manifest: the command, run on a copy, makes what the page counts
    browser.get(server + "/clips?where=" + urllib.request.quote(where))
    summary = browser.find_element(By.CSS_SELECTOR, "#as-manifest summary")
    summary.click()
    m = re.search(r"(\d+) clips; (\d+) views of cache t", summary.text)
    assert m, summary.text
    copy = tmp_path / "copy"
    shutil.copytree(demo_root, copy, ignore=shutil.ignore_patterns("view-cache"))
    commands = [browser.find_element(By.ID, "manifest-command"), *browser.find_elements(By.CSS_SELECTOR, "pre.cmd")[1:]]
    for i, (pre, n) in enumerate(zip(commands, (int(m[1]), int(m[2])), strict=True)):
        args = shlex.split(pre.text)
        assert args[:3] == ["reelcache", "catalog", "manifest"] and args[args.index("--where") + 1] == where
        args[args.index("--root") + 1], args[args.index("--name") + 1] = str(copy), f"sel{i}"
        made = Path(_main(*args[1:]).strip().splitlines()[-1])  # the path it prints
        assert pq.read_table(made if made.is_absolute() else copy / made).num_rows == n, (pre.text, n)


def test_a_manifest_counts_clips_and_views_and_lists_its_members(server, browser, demo_root):
    import pyarrow.parquet as pq
    from selenium.webdriver.common.by import By

    (path,) = _sql(demo_root, "SELECT path FROM manifests WHERE name = 'lat'")[0]
    table = pq.read_table(demo_root / path)
    members = sorted(set(table["clip_id"].to_pylist()))
    browser.get(server + "/manifest?name=lat")
    sizes = browser.find_element(By.ID, "sizes").text
    assert sizes.startswith(f"{len(members)} clips in {table.num_rows} views"), sizes
    assert len(members) < table.num_rows  # two views a clip: the two numbers differ
    source_rows = browser.find_elements(By.CSS_SELECTOR, "table.count-source tr")
    assert source_rows[0].text.split()[-1] == "views"
    assert sum(int(r.text.split()[-1]) for r in source_rows[1:]) == table.num_rows
    browser.find_element(By.ID, "its-clips").click()
    got = sorted(c.get_attribute("data-clip-id") for c in browser.find_elements(By.CSS_SELECTOR, "#grid .clip-card"))
    assert got == members


def test_a_clip_page_has_a_poster_a_download_and_says_a_random_vae_is_noise(server, browser, demo_root):
    from selenium.webdriver.common.by import By

    clip_id, path = _sql(demo_root, "SELECT clip_id, path FROM clips WHERE status = 'ok' AND codec = 'hevc' LIMIT 1")[0]
    browser.get(server + "/clip?id=" + urllib.request.quote(clip_id))
    assert "download" in browser.find_element(By.ID, "raw-why").text
    raw = browser.find_element(By.ID, "raw")
    assert raw.get_attribute("poster").endswith("/media/thumb?id=" + clip_id)
    with urllib.request.urlopen(browser.find_element(By.ID, "raw-download").get_attribute("href")) as r:
        assert r.read() == Path(path).read_bytes()
    (lat,) = _sql(demo_root, "SELECT clip_id FROM latents WHERE cache = 't' AND status = 'ok' LIMIT 1")[0]
    browser.get(server + "/clip?id=" + urllib.request.quote(lat))
    said = browser.find_element(By.CSS_SELECTOR, "figcaption.latent-what").text
    assert "random" in said and "noise" in said, said  # the demo's tiny VAE: seeded random weights (cache.json)


def test_the_run_page_rounds_ticks_and_plays_a_sample_with_a_quoted_name(server, browser, demo_root):
    import pyarrow.parquet as pq
    from selenium.webdriver.common.by import By

    browser.get(server + "/run?name=r")
    losses = pq.ParquetDataset(sorted(str(p) for p in (demo_root / "runs/r/metrics").glob("*.parquet"))).read()
    shown = [
        r.find_elements(By.TAG_NAME, "td")[2].text for r in browser.find_elements(By.CSS_SELECTOR, "#steps tr")[1:]
    ]
    by_step = dict(zip(losses["step"].to_pylist(), losses["loss"].to_pylist()))  # one generation: one row a step
    assert shown == [f"{by_step[k]:.4g}" for k in sorted(by_step)]
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg#loss g.xtick")) >= 2
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg#loss g.ytick")) >= 2
    (video,) = [v for v in browser.find_elements(By.CSS_SELECTOR, "video") if "cat" in v.get_attribute("src")]
    state, _ = _video(browser, video)
    assert state == HAVE_ENOUGH_DATA  # '#' and quotes encoded: the whole name reaches the server
