"""The viewer's browser tests' Chromium: Debian's headless chromium through Selenium and /usr/bin/chromedriver
(both paths given, so Selenium Manager never runs and nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
    "--window-size=1100,800",
]


def _driver(tmp_path_factory) -> Path:
    """chromedriver, and the Chromium it starts, without CAP_SYS_NICE where this runs as root. Run as root,
    headless Chromium put its processes under SCHED_FIFO priority 99 while a page played a video, and two of
    them spinning there starved this 2-core machine: the suite's own processes stopped being scheduled, and
    a SIGKILL stayed pending for minutes (seen in this session's validation run). Without the capability its
    requests for a real-time or raised priority are refused and it runs as any process does."""
    drop = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice"]
    if os.geteuid() != 0 or not shutil.which("setpriv") or subprocess.run([*drop, "true"]).returncode != 0:
        return Path(DRIVER)  # not root (no capability to drop), or a container that cannot drop it
    wrapper = tmp_path_factory.mktemp("chromedriver") / "chromedriver"
    wrapper.write_text(f'#!/bin/sh\nexec setpriv --bounding-set -sys_nice --inh-caps -sys_nice {DRIVER} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        pytest.skip("no Debian chromium + chromium-driver (make sysdeps installs them as root)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM  # both paths given: Selenium Manager never runs, nothing is downloaded
    for f in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(executable_path=str(_driver(tmp_path_factory))), options=opts)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()
