"""``reelcache view``: the viewer's arguments (reelcache/cli.py only registers them).

Nothing heavy is imported here: the parser builds without starlette, uvicorn, duckdb or torch."""

from __future__ import annotations

import argparse

from reelcache.args import arg, existing_dir
from reelcache.base.s3 import root_arg

# view/server.py (starlette, uvicorn, jinja2, duckdb) is imported by the command when it runs:
# `reelcache --help` builds every stage's parser.

EXAMPLES = """\
examples:
  reelcache view --root demo-root --videos demo-data/videos     # http://127.0.0.1:8050
  # on a cluster's head node, seen from a laptop through an ssh tunnel:
  ssh -L 8050:127.0.0.1:8050 head 'reelcache view --root /data/rc'   # then open http://127.0.0.1:8050
  # on every interface: a token is required (printed in the URL; REELCACHE_VIEW_TOKEN sets it)
  reelcache view --root /data/rc --host 0.0.0.0
  # a root in S3: the catalog `catalog merge --root s3://...` made in its local mirror, clips read by ranged GETs
  reelcache view --root s3://videos/rc
"""


def add_commands(top) -> None:
    p = top.add_parser(
        "view",
        help="a read-only web app over the catalog, caches and runs (rejects, clips, buckets, what a step saw)",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--root",
        required=True,
        type=root_arg,
        help="data root (catalog.duckdb, latents, runs): a folder, or s3://bucket/prefix (its merged catalog)",
    )
    p.add_argument("--port", type=arg(int, ge=0, le=65535), default=8050, help="TCP port (0: any free one)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; beyond it every request needs the viewer's token)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="what every request must carry (default: $REELCACHE_VIEW_TOKEN; beyond loopback a new one is "
        "made and printed in the URL; prefer the variable: a command line is visible to the machine's users)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the viewer is reached as besides its --host, loopback and this machine's names (repeatable)",
    )
    p.add_argument(
        "--queries",
        type=arg(int, ge=1, le=64),
        default=2,
        help="pages running user SQL at once (more: 503, retry) (default: 2)",
    )
    p.add_argument(
        "--query-seconds",
        type=arg(float, gt=0, le=3600),
        default=10.0,
        help="what all the user SQL of one page may take together (default: 10)",
    )
    p.add_argument(
        "--videos",
        action="append",
        default=[],
        type=existing_dir,
        help="a folder of input videos whose rejected files may be served too (repeatable; default: none)",
    )
    p.set_defaults(fn=_view)


def _view(a) -> None:
    from reelcache.view.server import serve

    serve(
        a.root, host=a.host, port=a.port, videos=a.videos, token=a.token, allow_hosts=a.allow_host,
        queries=a.queries, request_s=a.query_seconds,
    )  # fmt: skip
