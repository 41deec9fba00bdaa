"""The viewer's web app (Starlette routes, Jinja2 templates) and ``serve``, which runs it under uvicorn.

Routes are plain functions: Starlette runs each in its thread pool, each takes its own DuckDB cursor.
Every response is a page rendered on the server or a file under ROOT (or a byte range of one);
nothing here writes but preview.py's files under ROOT/view-cache/. A refused path or a bad query is
one line with a 4xx status, never a stack trace.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import sys
import threading
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from reelcache import UserError
from reelcache.view import pages, preview
from reelcache.view.files import Refused
from reelcache.view.store import Store

log = logging.getLogger("reelcache.view")


class NotFound(LookupError):
    pass


def build_app(root: str | Path, videos: list[str] | tuple = ()) -> Starlette:
    store = Store(root)

    async def refused(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=403)

    async def missing(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc).strip("'\""), status_code=404)

    async def bad(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=400)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # in the background, not on the first Clip page: the caption tagger's lexicon (~1 s) and, over a
        # root with latent caches, torch and diffusers for the VAE that decodes a view (~10 s)
        threading.Thread(target=_warm, args=(store.root,), daemon=True).start()
        yield
        store.close()

    app = Starlette(
        routes=[Route(path, fn) for path, fn in pages.ROUTES],
        exception_handlers={Refused: refused, NotFound: missing, KeyError: missing, UserError: bad, ValueError: bad},
        lifespan=lifespan,
    )
    app.state.store = store
    app.state.root = store.root
    app.state.videos = [Path(v).resolve() for v in videos]
    return app


def serve(root: str, host: str = "127.0.0.1", port: int = 8050, videos: list[str] | tuple = ()) -> None:
    import uvicorn

    app = build_app(root, videos)
    if not _loopback(host):
        print(
            f"reelcache view: warning: listening on {host}: anyone who can reach it reads this data root "
            "(no login); prefer 127.0.0.1 and an ssh tunnel",
            file=sys.stderr,
        )
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    # The URL once the socket is bound (port 0 picks a free one).
    startup = server.startup

    async def announce(sockets=None):
        await startup(sockets)
        for s in server.servers:
            for sock in s.sockets:
                h, p = sock.getsockname()[:2]
                print(f"reelcache view: http://{'[' + h + ']' if ':' in h else h}:{p}/  (Ctrl-C stops)", flush=True)
                return

    server.startup = announce
    server.run()


def _warm(root: Path) -> None:
    pages.tagger().tag("a warm up")
    if (root / "latents").is_dir():
        preview.import_vae_libraries()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
