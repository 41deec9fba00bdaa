"""`reelcache view` given bad URLs, without a browser: each is one line with a 4xx status, never a 500.

The app is Starlette's own, driven in-process by its TestClient over a catalog made by
catalog/db.py (empty tables) and a run directory that never started (no config.json).
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient  # needs httpx (pyproject's dev extra)

from reelcache.catalog.db import open_catalog
from reelcache.view.server import build_app


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewroot")
    open_catalog(root, write=True).close()
    (root / "runs" / "never-started" / "log").mkdir(parents=True)
    return TestClient(build_app(root), raise_server_exceptions=False)


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
