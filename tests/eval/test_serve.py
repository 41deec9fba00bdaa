"""`reelcache eval serve` against a real run (conftest.py): checkpoints taken in order, a partial one
skipped, a kill survived, the results logged into the training run's wandb run; --latest-only and
pruned checkpoints. The server runs as a real subprocess and is killed with SIGKILL. References are
independent of the code under test: PyAV reads the mp4s, wandb's own offline file format holds the
logged rows."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO, quiet_env
from wandb_files import history, run_files

from reelcache.cli import main
from reelcache.log import LINE_PREFIX

# Every test here evaluates the checkpoints of the session's real 2-process run (conftest.py): slow.
pytestmark = pytest.mark.slow

PROMPTS = REPO / "configs/eval/debug-prompts.txt"
RUN = "evalrun"  # the run conftest.py's `trained` writes


def _serve(root: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reelcache",
            "eval",
            "serve",
            "--root",
            str(root),
            "--run",
            f"runs/{RUN}",
            "--prompts",
            str(PROMPTS),
            "--val-manifest",
            "lat",
            "--preset",
            "debug",
            "--device",
            "cpu",
            "--poll",
            "0.2",
            "--val-max-clips",
            "5",
            *extra,
        ],
        cwd=REPO,
        env=quiet_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wandb_files_rows(run_dir: Path) -> list[dict]:
    """History rows of every offline run file under the run's wandb/ folder (training's and eval's)."""
    return [row for f in run_files(run_dir) for row in history(f)]


def _corrupt_copy(run_dir: Path, src: str, step: int) -> Path:
    """A complete-looking checkpoint (state.json present) whose model shard is garbage."""
    dst = run_dir / f"ckpt-{step:08d}"
    shutil.copytree(run_dir / src, dst)
    for f in (dst / "model").glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return dst


def test_serve_in_order_skips_partial_survives_kill_and_logs_to_the_run(trained):
    import av

    run = trained / "runs" / RUN
    out = run / "eval"
    # a checkpoint being written (never renamed): must be ignored; a corrupt one: logged, the server goes on
    partial = run / ".tmp-ckpt-00000006"
    shutil.copytree(run / "ckpt-00000004", partial)
    (partial / "state.json").unlink()
    bad = _corrupt_copy(run, "ckpt-00000002", 3)

    p = _serve(trained, "--max-attempts", "1")
    try:
        deadline = time.monotonic() + 120
        while not (out / "ckpt-00000002/debug/done.json").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-3000:]
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)  # mid-run: it is on ckpt-00000003 or -4 now
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    first = (out / "ckpt-00000002/debug/done.json").stat().st_mtime_ns

    p = _serve(trained, "--max-attempts", "1", "--exit-idle", "1")
    log, _ = p.communicate(timeout=180)
    assert p.returncode == 0, log[-4000:]
    assert (out / "ckpt-00000002/debug/done.json").stat().st_mtime_ns == first  # not redone
    assert "eval: ckpt-00000002" not in log
    assert not (out / ".tmp-ckpt-00000006").exists() and not (out / "ckpt-00000006").exists()
    assert (out / "ckpt-00000003/debug/error-1.txt").exists() and not (out / "ckpt-00000003/debug/done.json").exists()
    assert "ckpt-00000003 FAILED" in log or "ckpt-00000003 failed" in log
    done = {s: json.loads((out / f"ckpt-0000000{s}/debug/done.json").read_text()) for s in (2, 4)}
    assert (
        done[2]["seconds"] > 0
        and (out / "ckpt-00000002/debug/done.json").stat().st_mtime_ns
        < (out / "ckpt-00000004/debug/done.json").stat().st_mtime_ns
    )  # step order

    # videos: decodable H.264 with the preset's frame count and (even) size, one per prompt
    for s in (2, 4):
        vids = sorted((out / f"ckpt-0000000{s}/debug").glob("sample_*.mp4"))
        assert [v.name for v in vids] == ["sample_0.mp4", "sample_1.mp4"]
        for v in vids:
            with av.open(str(v)) as c:
                st = c.streams.video[0]
                frames = [f.to_ndarray(format="rgb24") for f in c.decode(st)]
                assert st.codec_context.name == "h264" and st.codec_context.pix_fmt == "yuv420p"
            assert len(frames) == 17 and frames[0].shape == (72, 128, 3)

    # validation loss: finite, per bucket, and the parquet holds both checkpoints
    import duckdb

    vl = {s: json.loads((out / f"ckpt-0000000{s}/val_loss.json").read_text()) for s in (2, 4)}
    for v in vl.values():
        assert v["clips"] == 5 and math.isfinite(v["overall"]) and v["buckets"]
        assert sum(b["clips"] for b in v["buckets"].values()) == v["clips"]
        assert len(v["timesteps"]) == 10
    assert vl[2]["overall"] != vl[4]["overall"]
    rows = duckdb.sql(
        f"SELECT global_step, loss FROM '{out / 'val_loss.parquet'}' WHERE bucket = 'all' AND t IS NULL ORDER BY 1"
    ).fetchall()
    assert rows == [(2, vl[2]["overall"]), (4, vl[4]["overall"])]

    # wandb: the training run's offline files (same run id) hold the trainer's rows and the eval rows
    run_id = (run / "wandb_id").read_text()
    assert all(run_id in d.name for d in run.glob("wandb/offline-run-*"))
    hist = wandb_files_rows(run)
    assert [r["global_step"] for r in hist if "train/loss" in r] == [0, 1, 2, 3]
    ev = {}
    for r in hist:
        if "eval/debug/val_loss" in r:
            ev[r["eval/global_step"]] = r
    assert sorted(ev) == [2, 4]
    for s, r in ev.items():
        assert r["eval/debug/val_loss"] == vl[s]["overall"]
        for b, x in vl[s]["buckets"].items():
            assert r[f"eval/debug/val_loss/{b}"] == x["loss"]
        for i, prompt in enumerate(PROMPTS.read_text().splitlines()[1:]):
            key = f"eval/debug/video_{i}/"  # media items are stored as nested keys
            assert r[key + "_type"] == "video-file" and r[key + "caption"] == prompt
            assert r[key + "path"].endswith(".mp4") and r[key + "size"] > 0
    shutil.rmtree(bad)  # the other tests use the real checkpoints only


def _serve_in_process(root: Path, run: str, *extra: str) -> int:
    """`eval serve` (validation loss of the first clip, debug tag) in this process, until idle."""
    return main(
        [
            "eval",
            "serve",
            "--root",
            str(root),
            "--run",
            run,
            "--val-manifest",
            "lat",
            "--val-max-clips",
            "1",
            "--preset",
            "debug",
            "--device",
            "cpu",
            "--wandb-mode",
            "disabled",
            "--poll",
            "0.05",
            "--exit-idle",
            "0.3",
            *extra,
        ]
    )


def _started(log: str) -> list[str]:
    """The checkpoints the server took up, in order (its "eval: ckpt-... (N pending)" lines)."""
    lines = LINE_PREFIX.sub("", log).splitlines()  # each line starts with the logger's time
    return [ln.split()[1] for ln in lines if ln.startswith("eval: ckpt-") and "pending)" in ln]


@pytest.mark.parametrize("latest_only", [True, False])
def test_serve_latest_only_takes_the_newest_pending_first(trained, capsys, monkeypatch, latest_only, run_copy):
    """--latest-only: each poll takes only the newest pending checkpoint, so ckpt-4 goes before ckpt-2,
    and ckpt-6, written while ckpt-4 is evaluated, goes next; ckpt-2, still pending, comes last
    (it is not skipped). Without the flag: step order. Only the choice is under test here, so
    evaluate() is a recorder that finishes the checkpoint as the real one does (done.json last)."""
    from reelcache.eval.evaluate import Evaluator

    run = run_copy(f"latest-{latest_only}")

    def evaluate(self, ckpt):
        if ckpt.name == "ckpt-00000004":  # the trainer saves step 6 meanwhile
            shutil.copytree(ckpt, ckpt.with_name("ckpt-00000006"), dirs_exist_ok=True)
        (self.out / ckpt.name / self.tag).mkdir(parents=True)
        (self.out / ckpt.name / self.tag / "done.json").write_text("{}")

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    assert _serve_in_process(trained, run, *(["--latest-only"] if latest_only else [])) == 0
    log = capsys.readouterr().err
    steps = [2, 4, 6] if not latest_only else [4, 6, 2]
    assert _started(log) == [f"ckpt-{s:08d}" for s in steps], log[-3000:]
    assert ("(2 pending)" in log) != latest_only


def test_serve_skips_a_checkpoint_pruned_before_its_turn(trained, capsys, monkeypatch, run_copy):
    """The trainer's keep_last pruning removes ckpt-2 right after the server listed it: the real
    evaluate() finds no checkpoint, and the server says so and skips it: no error file, no FAILED,
    no retry, exit status 0."""
    from reelcache.eval.evaluate import Evaluator

    run = run_copy("pruned", steps=(2,))
    listed = Evaluator.pending

    def pending_then_prune(self, *a, **k):
        todo = listed(self, *a, **k)
        if todo and todo[0].exists():
            shutil.rmtree(todo[0])  # Checkpointer's pruning, between the listing and the read
        return todo

    monkeypatch.setattr(Evaluator, "pending", pending_then_prune)
    assert _serve_in_process(trained, run) == 0
    log = capsys.readouterr().err
    assert "ckpt-00000002 was removed" in log and "skipped" in log, log[-3000:]
    assert "FAILED" not in log and not list((trained / run / "eval").glob("**/error-*.txt"))
    assert _started(log) == ["ckpt-00000002"]  # taken up once, never retried
