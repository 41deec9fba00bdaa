"""No script from the data runs in the viewer: hostile values in the data itself, in headless Chromium.

A plain path,text table names videos (copies of the demo's) whose file names and captions are script in
every context a page puts them: an ``.avi'-alert(origin)-'`` extension (a JS string inside an attribute,
the Clip page's old ``onerror``), a name that closes an attribute and opens an <img onerror>, captions
that close a <script>, a row whose missing file is such a name (a reject), and a run, an eval sample
(with a '#') and a stats plot whose file names are markup. Every page that shows
them is opened, with window.alert/confirm/prompt recorded (before any page script, through the DevTools
protocol): none is called, each value shows as the text it is (the table is the reference), and every
page carries the CSP that runs no inline script.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support import REPO, plan_ingest, quiet_env, sql

pytestmark = pytest.mark.browser

# name in the table -> (demo clip it copies (codec, ext), caption)
HOSTILE = {
    "x.avi'-alert(origin)-'": (("mpeg4", "avi"), '</script><script>alert("caption")</script> a cat'),
    'y"><img src=x onerror=alert(document.domain)>.mp4': (("h264", "mp4"), "<img src=x onerror=alert(1)> a dog"),
    "z'-alert(2)-'.webm": (None, "\"'><svg onload=alert(3)> a missing file"),
}
RUN = "r'\"><img src=x onerror=alert(5)>"
SAMPLE = "<img src=x onerror=alert(6)> #1.mp4"
PLOT = '"><svg onload=alert(7)>.png'
RECORD = """
window.__dialogs = [];
for (const k of ["alert", "confirm", "prompt"]) window[k] = (m) => { window.__dialogs.push(k + ":" + m); };
"""


@pytest.fixture(scope="module")
def hostile_root(ingested, tmp_path_factory) -> Path:
    from reelcache.cli import main

    base = tmp_path_factory.mktemp("hostile")
    videos, root = base / "videos", base / "root"
    videos.mkdir()
    rows = []
    for name, (kind, caption) in HOSTILE.items():
        if kind:
            (src,) = sql(ingested, f"SELECT path FROM clips WHERE status = 'ok' AND codec = '{kind[0]}' "
                                   f"AND ext = '{kind[1]}' ORDER BY clip_id LIMIT 1")[0]  # fmt: skip
            shutil.copyfile(src, videos / name)
        rows.append([name, caption])
    with open(base / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows([["path", "text"], *rows])
    units = plan_ingest(root, base / "table.csv", videos, "--source", "csv", "--name", "hostile")  # a path,text table
    assert main(["ingest", "run", "--root", str(root), *units]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    # a run, an eval sample and a plot whose names are markup (files of the root the pages list)
    run = root / "runs" / RUN
    (run / "metrics").mkdir(parents=True)
    (run / "eval" / "ckpt-000001").mkdir(parents=True)
    shutil.copyfile(videos / next(n for n in HOSTILE if n.endswith(".mp4")), run / "eval" / "ckpt-000001" / SAMPLE)
    (root / "stats").mkdir()
    shutil.copyfile(Path(REPO) / "docs" / "img" / "view-clips.png", root / "stats" / PLOT)
    return root


@pytest.fixture(scope="module")
def server(hostile_root):
    p = subprocess.Popen(
        [sys.executable, "-m", "reelcache", "view", "--root", str(hostile_root), "--port", "0",
         "--videos", str(hostile_root.parent / "videos")],
        cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    line = p.stdout.readline()
    m = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
    assert m, line + (p.stdout.read() if p.poll() is not None else "")
    yield m[1]
    p.terminate()
    p.wait(timeout=20)


@pytest.fixture(scope="module")
def recording(browser):
    """The browser with every dialog recorded instead of shown (before any script of a page runs)."""
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD})
    return browser


def _settled(driver, seconds: float = 3.0) -> None:
    """Until every image and video of the page has loaded or failed (their error handlers have run)."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, seconds + 60, 0.2).until(
        lambda d: d.execute_script(
            "return [...document.images].every(i => i.complete) && "
            "[...document.querySelectorAll('video')].every(v => v.error !== null || v.readyState >= 1)"
        )
    )


def test_no_script_from_the_data_runs_on_any_page(server, recording, hostile_root):
    browser = recording
    from selenium.webdriver.common.by import By

    clips = sql(hostile_root, "SELECT clip_id, path, text, status, ext, codec FROM clips ORDER BY path")
    assert len(clips) == len(HOSTILE) and {c[3] for c in clips} == {"ok", "rejected"}
    assert any(e == "avi'-alert(origin)-'" for *_, e, _ in clips)  # the extension as the data has it
    pages = ["/", "/rejects", "/clips?where=" + urllib.parse.quote("true"), "/run?name=" + urllib.parse.quote(RUN),
             "/clips?where=" + urllib.parse.quote("\"'><script>alert(4)</script>")]  # fmt: skip
    for clip_id, _path, _text, status, _ext, _codec in clips:
        pages.append(("/clip?id=" if status == "ok" else "/reject?id=") + urllib.parse.quote(clip_id))
    for page in pages:
        browser.get(server + page)
        _settled(browser)
        assert browser.execute_script("return window.__dialogs") == [], page
        with _any(server + page) as r:
            csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp, (page, csp)
        body = browser.find_element(By.TAG_NAME, "body").text
        if page.startswith(("/clip?", "/reject?")):
            (text,) = [t for c, _, t, *_ in clips if urllib.parse.quote(c) in page]
            assert text in body, (page, text)  # shown as the text it is
        if page == "/":
            assert RUN in body and f"stats/{PLOT}" in body
            assert browser.execute_script("return [...document.images].every(i => i.naturalWidth > 0)")  # plot shown
        if page.startswith("/run?"):
            assert SAMPLE in body
            (video,) = browser.find_elements(By.TAG_NAME, "video")
            assert browser.execute_script("return arguments[0].error", video) is None  # '#' encoded: it plays
        if page == "/rejects":
            (missing,) = [p for _, p, _, s, *_ in clips if s == "rejected"]
            assert missing in body
    # the avi's page says in text why it does not play, the codec and the hostile extension as text, once
    # its video has failed (the moment the old inline handler ran the extension as script)
    from selenium.webdriver.support.ui import WebDriverWait

    (avi,) = [c for c, *_, e, _ in clips if (e or "").startswith("avi")]
    browser.get(server + "/clip?id=" + urllib.parse.quote(avi))
    WebDriverWait(browser, 60, 0.2).until(lambda d: d.find_element(By.ID, "raw-error").text)
    assert browser.execute_script("return window.__dialogs") == []
    said = browser.find_element(By.ID, "raw-error").text
    assert "cannot play mpeg4 in avi'-alert(origin)-' (media error" in said, said
    said = browser.find_element(By.ID, "raw-why").text
    assert "avi'-alert(origin)-'" in said and "mpeg4" in said, said


def _any(url: str):
    """The response of a URL whatever its status (a bad WHERE is a 400 page)."""
    try:
        return urllib.request.urlopen(url)
    except urllib.error.HTTPError as e:
        return e
