"""Ingest's MB/s into S3 (a SeaweedFS on loopback, tests/s3_local.py) against a local root, same input, one run:

    local -> local    the videos in a folder, the root a folder (the baseline)
    local -> S3       the videos in a folder, the root s3://  (shards staged locally, uploaded whole)
    S3 -> local       the videos in S3 (probed by ranged reads, copied by ranged reads), the root a folder
    S3 -> S3          both in S3

    .venv/bin/python bench/bench_ingest_s3.py [CLIPS] [ROUNDS]

Input: the demo's generated OpenVid table (reelcache.ingest.demo, CLIPS clips of ~25-180 kB and its broken files),
`--rows-per-unit 40`, `--max-file-mb 8`; every unit run in this process (`ingest run` as one GNU parallel slot
runs them). MB/s is the accepted clips' bytes over the wall time of the units' runs (plan and merge left out).
Configurations run in interleaved rounds, each on a fresh root, so load from elsewhere hits them alike; the
median of the rounds is printed, with the machine's load. Small clips: this measures per-file costs (probes,
requests), not bandwidth.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def run(root: str, meta: Path, videos: str, name: str) -> tuple[float, int]:
    """Plan (not timed), then every unit: (seconds of the runs, accepted bytes)."""
    from reelcache.cli import main
    from reelcache.ingest.run import run_unit

    out = io.StringIO()
    args = ["ingest", "plan", "--root", root, "--source", "openvid", "--name", name, "--meta", str(meta)]
    with contextlib.redirect_stdout(out):
        assert main([*args, "--videos", videos, "--rows-per-unit", "40", "--max-file-mb", "8"]) == 0
    units = out.getvalue().split()
    t0 = time.perf_counter()
    done = [run_unit(root, u) for u in units]
    return time.perf_counter() - t0, sum(d["bytes"] for d in done)


def main() -> None:
    clips = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    from s3_local import local_s3

    from reelcache.base import s3
    from reelcache.ingest.demo import generate

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp, local_s3() as server:
        tmp = Path(tmp)
        os.environ.update(server.env())
        os.environ["REELCACHE_S3_MIRROR"] = str(tmp / "mirror")
        s3.forget_clients()
        meta = Path(generate(tmp / "data", n=clips, seed=3, workers=2))
        videos = meta.parent / "videos"
        c = server.client()
        for p in sorted(videos.iterdir()):
            c.upload_file(str(p), server.shared_bucket, f"videos/{p.name}")
        s3videos = f"s3://{server.shared_bucket}/videos"
        configs = {
            "local -> local": (lambda i: str(_mkdir(tmp / f"root{i}")), str(videos)),
            "local -> S3": (lambda i: f"s3://{server.shared_bucket}/r{i}", str(videos)),
            "S3 -> local": (lambda i: str(_mkdir(tmp / f"rootv{i}")), s3videos),
            "S3 -> S3": (lambda i: f"s3://{server.shared_bucket}/rv{i}", s3videos),
        }
        got: dict[str, list[float]] = {k: [] for k in configs}
        nbytes = 0
        for r in range(reps):
            for k, (root, vids) in configs.items():
                dt, nbytes = run(root(r), meta, vids, "openvid")
                got[k].append(nbytes / 1e6 / dt)
        print(f"{clips} clips, {nbytes / 1e6:.1f} MB accepted; {reps} interleaved rounds, median MB/s")
        print("| videos -> root | MB/s | x local | rounds |")
        print("|---|---|---|---|")
        base = statistics.median(got["local -> local"])
        for k, v in got.items():
            m = statistics.median(v)
            print(f"| {k} | {m:.1f} | {m / base:.2f} | {', '.join(f'{x:.1f}' for x in v)} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


if __name__ == "__main__":
    main()
