"""A run whose root is in object storage (``--root s3://bucket/prefix``, docs/STORAGE.md): where its folder lives.

The run folder ``runs/<run>/`` is written on the local disk, under the root's local mirror (base/s3.py:
``mirror_dir``: ``<mirror>/<bucket>/<prefix>/runs/<run>/``), exactly as under a local root, and each finished
file is published as a whole object under ``s3://bucket/prefix/runs/<run>/`` (``RunFiles.publish``): never a part
of one. Each rank publishes the files it writes (those named ``rank<NNNNN>``: its consumed-log parts, its log,
its rank record, its stacks), rank 0 the others (config.json, metrics parts, bad_steps.jsonl, wandb_id): at the
start (config, rank records), at each checkpoint (before its writer starts: the metrics and the consumed log up to
the step exist in S3 before the checkpoint does) and at the end. A file is sent again only when it changed (its
size or mtime); a part written once (``RUN_WRITTEN_ONCE``: the consumed log's, the metrics') is not looked at again
once published, so a publish costs a listing of each folder and a stat of the files that may still change. The
wandb offline folder stays in the mirror (``wandb sync`` it from there).

Checkpoints (train/checkpoint.py) go up from rank 0's writer thread, ``state.json`` last: a ``ckpt-<step>/``
prefix is a complete checkpoint only once its ``state.json`` object exists (``list_checkpoints``). A checkpoint
to resume or evaluate is downloaded into the mirror (``fetch``) and read there as a folder.

A local root has no remote: every call here is then a no-op, and the run folder is the root's own.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from reelcache import UserError
from reelcache.base import s3

__all__ = ["TEMPORARY", "RunFiles", "fetch", "mirrored_inputs", "run_place"]

_RANK = re.compile(r"rank(\d{5})")
TEMPORARY = re.compile(r"(^|/)\.[^/]*\.tmp")  # a file being written (reelcache/files.py: tmp_name)
# not published by RunFiles: checkpoints (the writer's), the lease and the stop request (objects of their own), the
# wandb offline folder, a Slurm job's folder (its script is uploaded when submitted, its log stays on the node:
# cluster/slurm/jobs.py), temporaries
RUN_NOT_PUBLISHED = re.compile(r"^(ckpt-\d{8}/|\.tmp-|wandb/|slurm/|run\.lease$|stop$)|" + TEMPORARY.pattern)
# written once (atomically, under a name never used again) and never changed: once published, not looked at again
RUN_WRITTEN_ONCE = re.compile(r"^(consumed|metrics)/[^/]+\.parquet$")
# What of a root a run reads, mirrored down before it starts: the manifests (by name) and the takedowns' record.
_INPUTS = re.compile(r"manifests/[^/]+\.(parquet|json)|withdrawn/[^/]+\.parquet")
_INPUTS_UNDER = ("manifests/", "withdrawn/")  # the folders listed for them (base/s3.py: sync_down's under)


def run_place(root, name: str) -> tuple[Path, Path, s3.Url | None]:
    """(the local root, the local run folder, the run's prefix in S3 or None) of run `name` under `root`."""
    if s3.is_url(root):
        url = s3.parse(root)
        local = s3.mirror_dir(url)
        return local, local / "runs" / name, url / "runs" / name
    return Path(root), Path(root) / "runs" / name, None


def mirrored_inputs(root) -> Path:
    """A root in S3: its manifests and takedowns brought into its local mirror (where the loader finds them by
    name, as ``cache plan`` does); the local root (the mirror, or the folder root itself)."""
    if not s3.is_url(root):
        return Path(root)
    s3.sync_down(root, s3.mirror_dir(root), lambda rel: _INPUTS.fullmatch(rel) is not None, under=_INPUTS_UNDER)
    return s3.mirror_dir(root)


def fetch(url) -> Path:
    """A checkpoint (or any prefix) in S3 downloaded into the root's mirror, at the same path below it; the local
    folder (files already there with the object's size and time are not downloaded again). A single object (a
    weights file) is downloaded as a file there; nothing at `url` is one line naming it."""
    url = s3.parse(url)
    local = s3.mirror_dir(url)
    if s3.sync_down(url, local, lambda rel: True):
        return local
    if s3.head(url) is None:
        raise UserError(f"nothing at {url}: no object, and no object under it")
    local.parent.mkdir(parents=True, exist_ok=True)
    s3.download(url, local)
    return local


class RunFiles:
    """This rank's publisher of a run folder's finished files (module docstring); a no-op for a local root."""

    def __init__(
        self,
        local: Path,
        remote: s3.Url | None,
        rank: int,
        skip: re.Pattern = RUN_NOT_PUBLISHED,
        once: re.Pattern | None = RUN_WRITTEN_ONCE,
    ):
        self.local, self.remote, self.rank, self.skip, self.once = Path(local), remote, rank, skip, once
        self.lease = None  # rank 0's run lease: verified before it publishes (a run that lost it overwrites nothing)
        self.sent: dict[str, tuple[int, int]] | None = None  # rel -> (size, mtime_ns) as published
        # per folder (rel, '' the run's): its subfolders, and the names settled for good (not this rank's or
        # skipped, by their name; or written once and published): a publish looks only at the others
        self._dirs: dict[str, tuple[set[str], set[str]]] = {}

    def mine(self, rel: str) -> bool:
        if self.skip.search(rel):
            return False
        m = _RANK.search(rel.rsplit("/", 1)[-1])
        return (int(m[1]) if m else 0) == self.rank

    def url(self, path) -> s3.Url:
        return self.remote / Path(path).relative_to(self.local).as_posix()

    def _candidates(self) -> dict[str, os.stat_result]:
        """rel -> stat of this rank's files that may have changed since the last publish: the run folder is walked
        by name (a listing of each folder), and only names not settled for good are looked at (stat). A long run's
        tens of thousands of consumed-log parts cost a folder listing, not a stat each (bench/bench_runfiles.py)."""
        out = {}
        todo = [""]
        while todo:
            d = todo.pop()
            try:
                names = os.listdir(self.local / d)
            except (FileNotFoundError, NotADirectoryError):
                self._dirs.pop(d, None)
                continue
            subdirs, settled = self._dirs.setdefault(d, (set(), set()))
            for name in set(names) - settled:
                rel = f"{d}/{name}" if d else name
                if name in subdirs:
                    todo.append(rel)
                    continue
                try:
                    st = os.stat(self.local / rel)
                except FileNotFoundError:  # gone since listed (a temporary renamed)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if self.skip.search(rel + "/"):
                        settled.add(name)  # a checkpoint, the wandb folder: never published
                    else:
                        subdirs.add(name)
                        todo.append(rel)
                elif not stat.S_ISREG(st.st_mode) or not self.mine(rel):
                    settled.add(name)  # by its name: another rank's, or one not published
                else:
                    out[rel] = st
        return out

    def _settle(self, rel: str) -> None:
        """`rel` is published and written once: no publish looks at it again."""
        if self.once is not None and self.once.search(rel):
            d, _, name = rel.rpartition("/")
            self._dirs.setdefault(d, (set(), set()))[1].add(name)

    def _there(self, rels) -> dict[str, dict]:
        """What the run's prefix holds of `rels` (Size, LastModified): in each folder, a listing of the prefix the
        names share (this rank's consumed parts: ``consumed/rank<N>-``, not every rank's), a HEAD of each file at
        the top (config.json, wandb_id, ...), never a listing of the whole run."""
        base = self.remote.key.rstrip("/") + "/"
        folders: dict[str, list[str]] = {}
        for rel in rels:
            folders.setdefault(rel.rpartition("/")[0], []).append(rel)
        out = {}
        for d, names in sorted(folders.items()):
            if not d:
                for rel in names:
                    if (h := s3.head(self.remote / rel)) is not None:
                        out[rel] = {"Size": h["ContentLength"], "LastModified": h["LastModified"]}
                continue
            for o in s3.list_objects(s3.Url(self.remote.bucket, base + os.path.commonprefix(names))):
                out[o["Key"][len(base) :]] = o
        return out

    def publish(self) -> int:
        """Upload this rank's files of the run folder that changed since they were last published, each whole;
        returns how many. The first call skips what the run's prefix already holds with the same size (``_there``:
        asked of this rank's files only)."""
        if self.remote is None or not self.local.is_dir():
            return 0
        found = self._candidates()
        if self.sent is None:
            self.sent = {}
            there = self._there(found)
            for rel, st in found.items():
                if rel in there:
                    if st.st_size == there[rel]["Size"] and st.st_mtime <= there[rel]["LastModified"].timestamp():
                        self.sent[rel] = (st.st_size, st.st_mtime_ns)
        n = 0
        for rel in sorted(found, key=lambda rel: (rel.rsplit("/", 1)[-1] == "done.json", rel)):  # a record's last
            st = found[rel]
            if self.sent.get(rel) != (st.st_size, st.st_mtime_ns):
                if n == 0 and self.lease is not None:
                    self.lease.verify()
                s3.upload_file(self.local / rel, self.remote / rel)
                self.sent[rel] = (st.st_size, st.st_mtime_ns)
                n += 1
            self._settle(rel)
        return n
