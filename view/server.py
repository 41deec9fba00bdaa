"""The viewer's web app (Starlette routes, Jinja2 templates) and ``serve``, which runs it under uvicorn.

Routes are plain functions: Starlette runs each in its thread pool, each takes its own DuckDB cursor.
Every response is a page rendered on the server or a file under ROOT (or a byte range of one);
nothing here writes but preview.py's files under ROOT/view-cache/. A refused path or a bad query is
one line with a 4xx status, never a stack trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import sys
import threading
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from reelcache import UserError
from reelcache.view import pages, preview
from reelcache.view.files import Gone, NotFound, Refused
from reelcache.view.guard import LOOPBACK_NAMES, TOKEN_ENV, Guard, check_token, host_names, loopback, wildcard
from reelcache.view.store import Busy, Store

log = logging.getLogger("reelcache.view")


def build_app(
    root: str | Path,
    videos: list[str] | tuple = (),
    names: set[str] | None = None,
    token: str | None = None,
    **limits,
) -> Starlette:
    """The app over ROOT; ``names``: what a Host header may name (default: loopback names); ``token``: what
    every request must carry (None: nothing); ``limits``: Store's (queries at once, seconds a request)."""
    local, remote = view_root(root)
    store = Store(local, named=root, **limits)

    async def refused(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=403)

    async def gone(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=410)

    async def missing(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc).strip("'\""), status_code=404)

    async def bad(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=400)

    async def busy(request: Request, exc: Busy) -> Response:
        return PlainTextResponse(str(exc), status_code=503, headers={"Retry-After": str(exc.retry_after)})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # in the background, not on the first Clip page: the caption tagger's lexicon (~1 s) and, over a
        # root with latent caches, torch and diffusers for the VAE that decodes a view (~10 s)
        threading.Thread(target=_warm, args=(store.root,), daemon=True).start()
        yield
        store.close()

    static = StaticFiles(directory=Path(__file__).with_name("static"))
    app = Starlette(
        routes=[*(Route(path, fn) for path, fn in pages.ROUTES), Mount("/static", static)],
        exception_handlers={
            Refused: refused, Gone: gone, NotFound: missing, KeyError: missing, Busy: busy, UserError: bad,
            ValueError: bad,
        },
        middleware=[Middleware(Guard, names=set(LOOPBACK_NAMES) if names is None else names, token=token)],
        lifespan=lifespan,
    )  # fmt: skip
    app.state.store = store
    app.state.root = store.root
    app.state.remote = remote  # a root in S3: the shards' objects are read from it (pages._raw_shard)
    app.state.data = str(remote) if remote else str(store.root)
    app.state.videos = [Path(v).resolve() for v in videos]
    return app


# What the pages read of a root in S3 besides the catalog: the manifests, and each cache's documents.
VIEWED = re.compile(r"manifests/[^/]+\.(parquet|json)|latents/[^/]+/cache\.json|latents/[^/]+/_plan/plan\.json")
VIEWED_UNDER = ("manifests/", "latents/")  # the folders listed for them (base/s3.py: sync_down's under)


def view_root(root) -> tuple[Path, object]:
    """(the local folder of the catalog and the viewer's files, the root's base/s3.py Url or None). A root in S3
    is viewed from its local mirror (docs/STORAGE.md), where `catalog merge --root s3://...` made the catalog;
    the manifests and caches' documents the pages read are mirrored first (only what changed)."""
    from reelcache.base import s3

    if not s3.is_url(root):
        return Path(root), None
    url = s3.check_root(root, write=False)
    local = s3.mirror_dir(url)
    s3.sync_down(url, local, lambda rel: VIEWED.fullmatch(rel) is not None, under=VIEWED_UNDER)
    return local, url


STOP_S = 5.0  # on SIGTERM / Ctrl-C, how long open responses (a stalled download) may take to finish


def serve(
    root: str,
    host: str = "127.0.0.1",
    port: int = 8050,
    videos: list[str] | tuple = (),
    token: str | None = None,
    allow_hosts: list[str] | tuple = (),
    **limits,
) -> None:
    import uvicorn

    token = token or os.environ.get(TOKEN_ENV) or None
    if token is not None:
        check_token(token)
    elif not loopback(host):
        token = secrets.token_urlsafe(24)  # beyond this machine: never without one
    app = build_app(root, videos, names=host_names(host, allow_hosts), token=token, **limits)
    if not loopback(host):
        print(
            f"reelcache view: listening on {host}: whoever has the URL with its token reads this data root; "
            "prefer 127.0.0.1 and an ssh tunnel",
            file=sys.stderr,
        )
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=STOP_S
    )
    server = uvicorn.Server(config)

    # The URL once the socket is bound (port 0 picks a free one).
    startup = server.startup

    async def announce(sockets=None):
        await startup(sockets)
        for s in server.servers:
            for sock in s.sockets:
                h, p = sock.getsockname()[:2]
                h = socket.gethostname() if wildcard(host) else h
                query = f"?token={token}" if token else ""
                url = f"http://{'[' + h + ']' if ':' in h else h}:{p}/{query}"
                print(f"reelcache view: {url}  (Ctrl-C stops)", flush=True)
                return

    server.startup = announce
    server.run()


def _warm(root: Path) -> None:
    pages.tagger().tag("a warm up")
    if (root / "latents").is_dir():
        preview.import_vae_libraries()
