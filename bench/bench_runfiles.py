"""What one ``RunFiles.publish`` costs a rank at a checkpoint (train/runfiles.py), on a run folder holding PARTS
consumed-log parts (a long run's), spread over RANKS ranks, plus metrics parts, logs and rank records.

    .venv/bin/python bench/bench_runfiles.py [PARTS] [RANKS]

Each rank's publisher first publishes the folder as it is; then, REPEATS times, one new consumed part of each rank
and one metrics part are written and each rank's log grows (what a checkpoint's interval leaves), and each rank's
``publish`` is timed. The uploads are counted, not sent (s3.upload_file replaced by a counter): what is measured is
finding what changed, the walk of the folder. Printed: the median and the slowest ms of a publish for rank 0 and
for another rank, and how many files each sent (one part, its log; rank 0 also the metrics part).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from reelcache.base import s3
from reelcache.train import runfiles
from reelcache.train.runfiles import RunFiles

REPEATS = 10


def main() -> None:
    parts = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    sent = []
    runfiles.s3.upload_file = lambda path, url, metadata=None: sent.append(url)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "runs" / "r"
        for d in ("consumed", "metrics", "log", "ranks", "ckpt-00000100/model"):
            (run / d).mkdir(parents=True)
        (run / "config.json").write_text("{}")
        for r in range(ranks):
            (run / "ranks" / f"rank{r:05d}.json").write_text("{}")
            (run / "log" / f"rank{r:05d}.log").write_text("start\n")
        for i in range(parts):
            r, s = i % ranks, i // ranks
            (run / "consumed" / f"rank{r:05d}-g000-e0000-s{s:09d}.parquet").write_bytes(b"p" * 600)
        for s in range(parts // ranks // 10):
            (run / "metrics" / f"g000-s{s * 10:09d}-{s * 10 + 9:09d}.parquet").write_bytes(b"m" * 900)
        (run / "ckpt-00000100/model/w.safetensors").write_bytes(b"w")
        pubs = [RunFiles(run, s3.Url("bucket", "root/runs/r"), r) for r in (0, ranks - 1)]
        for p in pubs:
            p.sent = {}  # as after a fresh start: nothing in S3 yet (no listing of it here)
            p.publish()
        times = {p.rank: [] for p in pubs}
        counts = {p.rank: [] for p in pubs}
        step = parts // ranks
        for _ in range(REPEATS):
            step += 1
            for r in range(ranks):
                (run / "consumed" / f"rank{r:05d}-g000-e0000-s{step:09d}.parquet").write_bytes(b"p" * 600)
                with open(run / "log" / f"rank{r:05d}.log", "a") as f:
                    f.write(f"step {step}\n")
            (run / "metrics" / f"g000-s{step * 10:09d}-{step * 10 + 9:09d}.parquet").write_bytes(b"m" * 900)
            for p in pubs:
                sent.clear()
                t0 = time.perf_counter()
                p.publish()
                times[p.rank].append(1000 * (time.perf_counter() - t0))
                counts[p.rank].append(len(sent))
        files = sum(1 for f in run.rglob("*") if f.is_file())
        print(f"run folder: {files} files ({parts} consumed parts over {ranks} ranks); {REPEATS} publishes a rank")
        for p in pubs:
            t = times[p.rank]
            print(
                f"rank {p.rank}: publish median {statistics.median(t):.1f} ms, slowest {max(t):.1f} ms; "
                f"files sent a publish: {sorted(set(counts[p.rank]))}"
            )


if __name__ == "__main__":
    main()
