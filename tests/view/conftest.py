"""The viewer's browser tests' Chromium: Debian's headless chromium through Selenium and /usr/bin/chromedriver
(both paths given, so Selenium Manager never runs and nothing is downloaded)."""

from __future__ import annotations

import shutil
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
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()
