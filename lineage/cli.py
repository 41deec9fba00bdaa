"""``reelcache lineage`` and ``reelcache takedown``: the lineage stage's arguments (reelcache/cli.py only
assembles). Nothing heavy is imported here: the parser builds without duckdb or pyarrow."""

from __future__ import annotations

import argparse
import json

from reelcache.args import existing_file
from reelcache.base.s3 import root_arg

# lineage/lineage.py, select.py and takedown.py (duckdb, pyarrow) are imported by the command that runs them.

EXAMPLES = """\
examples:
  reelcache lineage --root /data/rc 3f2a9c01d4e5b6a7c8d9
  reelcache lineage --root /data/rc --like request-1234.mp4 --json
  reelcache lineage --root /data/rc --where "source = 'openvid' AND relpath LIKE 'channel-x/%'"
  reelcache takedown --root /data/rc --like request-1234.mp4 --reason "removal request #1234"
  reelcache takedown --root /data/rc --like request-1234.mp4 --reason "removal request #1234" --apply
  reelcache takedown --root s3://videos/rc --like request-1234.mp4 --reason "removal request #1234" --apply
"""


def _selection(p: argparse.ArgumentParser, file: bool = True) -> None:
    p.add_argument("--root", required=True, type=root_arg, help="a folder, or s3://bucket/prefix (its merged catalog)")
    p.add_argument("clip_ids", nargs="*", metavar="CLIP_ID", help="clip ids (or one of the options below)")
    p.add_argument("--where", help="one SQL condition on clips (run read-only)")
    if file:
        p.add_argument("--file", type=existing_file, help="a text file of clip ids, one a line")
    p.add_argument("--like", type=existing_file, metavar="VIDEO_FILE", help="the clips whose raw bytes are this file's")


def add_commands(top) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    lin = top.add_parser(
        "lineage",
        help="a clip's shard member, same-video and same-caption clips, latents, manifests, runs, steps, checkpoints",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    _selection(lin)
    lin.add_argument("--json", action="store_true", help="print JSON (a list, one object per clip)")
    lin.set_defaults(fn=_lineage)
    td = top.add_parser(
        "takedown",
        help="withdraw clips everywhere (dry run unless --apply) and name the checkpoints trained on them",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    _selection(td, file=True)
    td.add_argument("--reason", required=True, help="why (the request, a ticket): kept in the withdrawn record")
    td.add_argument("--apply", action="store_true", help="withdraw them (default: a dry run that changes nothing)")
    td.add_argument("--json", action="store_true", help="also print the plan (the journal) as JSON")
    td.set_defaults(fn=_takedown)


def _local(a, write: bool = False, mirror: bool = True):
    """The folder of the catalog: the root, or for a root in S3 its local mirror, where `catalog merge --root s3://`
    made it (the root checked first, and, with `mirror`, what lineage reads besides the catalog mirrored:
    lineage/takedown.py; takedown mirrors it itself, when it plans)."""
    from reelcache.base import s3

    if not s3.is_url(a.root):
        return a.root
    from reelcache.lineage.takedown import Files

    s3.check_root(a.root, write=write)
    files = Files(a.root)
    if mirror:
        files.sync()
    return files.root


def _ids(a, con, local) -> list[str]:
    from reelcache.lineage.lineage import check_schema
    from reelcache.lineage.select import select

    check_schema(con, local)  # an older catalog is one line here, before a query reads content_hash
    return select(con, local, ids=a.clip_ids, where=a.where, file=a.file, like_file=a.like)


def _lineage(a) -> None:
    from reelcache.catalog.sql import read_only_connection
    from reelcache.lineage.lineage import lineage, render

    local = _local(a)
    with read_only_connection(local) as con:
        items = lineage(con, local, _ids(a, con, local), update_index=True)
    print(json.dumps(items, indent=1, default=str) if a.json else render(items))


def _takedown(a) -> None:
    from reelcache.catalog.sql import read_only_connection
    from reelcache.lineage.takedown import takedown

    local = _local(a, write=a.apply, mirror=False)  # the selection reads the catalog alone
    with read_only_connection(local) as con:
        ids = _ids(a, con, local)
    j = takedown(a.root, ids, a.reason, apply=a.apply)
    if a.json:
        print(json.dumps(j, indent=1, default=str))
