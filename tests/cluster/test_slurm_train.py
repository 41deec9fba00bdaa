"""Training under Slurm, for real: `reelcache train --slurm` on a one-node local Slurm (tests/slurm_local.py).

The cluster runs with JobRequeue=0 (as many sites do): only a job that asks for `--requeue` can be
requeued, so the script's own `--requeue` is what these tests rely on.

A 2-rank CPU training of the debug stage is requeued mid-run (`scontrol requeue`) and resumes from its
newest checkpoint in the same run directory, ending loss for loss and weight for weight where an
uninterrupted run (torchrun, no Slurm) ends, while `eval serve --slurm --after` follows it and ends
once it has ended and every checkpoint is evaluated; a job that reaches its time limit checkpoints at
the warning signal and requeues itself; each documented way to stop does what docs/CLUSTER.md says
(`scancel --signal=USR2` and the stop file stop, `scancel --batch --signal=USR2` stops and requeues);
bad resources and inputs are refused in one line before anything is submitted; `reelcache cluster`
expands the allocation's node list as `scontrol show hostnames` does.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from latent_data import write_latents
from slurm_local import local_slurm_or_skip
from support import REPO, WHOLE, data_args, free_port, metrics, same_data, same_run

from reelcache.cluster.hosts import expand_nodelist

pytestmark = pytest.mark.slurm
CONFIG = "configs/train/debug/stage1.toml"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with local_slurm_or_skip(tmp_path_factory.mktemp("slurm"), job_requeue=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, Path]:
    r = tmp_path_factory.mktemp("slurm-train-root")
    return r, write_latents(r, 24, name="train")


def submit(slurm, root: Path | str, *args: str, ok: bool = True, env: dict | None = None):
    cmd = [sys.executable, "-m", "reelcache", "train", CONFIG, "--root", str(root), "--slurm", *args]
    p = subprocess.run(cmd, env=env or slurm.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p


def job_id(p: subprocess.CompletedProcess) -> str:
    return p.stdout.split("submitted job ")[1].split(":")[0]


def wait_for(cond, what: str, slurm, job: str, run: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        gone = not slurm.run("squeue", "--noheader", "--jobs", job, check=False).stdout.strip()
        assert not gone and time.monotonic() < deadline, f"waiting for {what}: job {job} ended\n{job_log(run)[-3000:]}"
        time.sleep(0.2)


def text_of(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def job_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "slurm").glob("*.out")))


def eval_serve(
    slurm, root: Path | str, manifest: Path | str, run: str, *args: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reelcache", "eval", "serve", "--root", str(root), "--run", run]
    cmd += ["--preset", "debug", "--device", "cpu", "--val-manifest", str(manifest), "--val-max-clips", "4"]
    cmd += ["--poll", "1", "--wandb-mode", "disabled", "--slurm", *args]
    return subprocess.run(cmd, env=env or slurm.env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_requeued_job_resumes_from_its_newest_checkpoint_and_ends_like_an_uninterrupted_run(
    slurm, root, ddp_reference
):
    """... and eval serve --slurm --after <job> (no --exit-idle) follows it: it starts before the first
    checkpoint exists, waits through the requeue, and ends once the job has ended and every
    checkpoint is evaluated, on one (fake) GPU of its own."""
    r, manifest = root
    args = data_args(manifest, *WHOLE)
    same_data(ddp_reference.parents[1], r)  # the uninterrupted run: the session's (auto: DDP on CPU)
    p = submit(slurm, r, "--gpus-per-node=0", "--nproc-per-node=2", *args, "--run.name=requeued")
    job, run = job_id(p), r / "runs/requeued"
    ev = eval_serve(slurm, r, manifest, "runs/requeued", "--gpus-per-node", "1", "--after", job)
    assert ev.returncode == 0, ev.stderr
    eval_job = ev.stdout.split("submitted job ")[1].split(":")[0]
    wait_for(lambda: (run / "ckpt-00000004").exists(), "the first checkpoint", slurm, job, run)
    slurm.run("scontrol", "requeue", job)
    (record,) = slurm.wait(job, timeout=300)
    log = job_log(run)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, log[-3000:])
    (evaluated,) = slurm.wait(eval_job, timeout=240)
    eval_log = "".join(f.read_text() for f in (run / "slurm").glob("eval-*.out"))
    assert evaluated["JobState"] == "COMPLETED", (evaluated, eval_log[-3000:])
    assert "the training job has ended and every checkpoint is evaluated" in eval_log, eval_log[-3000:]
    assert sorted(c.name for c in (run / "eval").glob("ckpt-*") if (c / "val_loss.json").exists()) == sorted(
        c.name for c in run.glob("ckpt-*")
    )
    assert "#SBATCH --gpus-per-node=1" in (run / "slurm/eval.sbatch").read_text()
    assert "attempt 0" in log and "attempt 1" in log and "resumed from" in log, log[-3000:]
    same_run(ddp_reference, run, 15, which=("model", "ema"))
    assert max(row["generation"] for row in metrics(run).values()) == 1  # the second attempt trained the rest


def test_a_job_on_an_s3_root_requeued_resumes_from_s3_and_ends_like_an_uninterrupted_run(
    slurm, root, ddp_reference, s3_server, tmp_path
):
    """docs/STORAGE.md "A run in S3" under Slurm (cluster/slurm/jobs.py): the data and a manifest (by name) in
    S3 on the session's SeaweedFS, `train --slurm --root s3://` and `eval serve --slurm --after <job>` each
    submitted with a mirror of its own and the AWS_* variables in the submitter's environment (nothing else in
    the script). The job is requeued (`scontrol requeue`) after its first checkpoint is an object, resumes from
    the newest complete checkpoint in S3, and ends loss for loss and weight for weight where the session's
    uninterrupted run ends; its run read back by a plain boto3 client holds every checkpoint of that run, file
    for file, each with its state.json; the script is an object beside the run, the Slurm log stays in the
    mirror on the node, where the trap's stop file is the trainer's. The evaluation job evaluates every
    checkpoint, its records in S3: ckpt-15's validation loss is that of `eval once` over the reference's."""
    import secrets

    from s3_local import download_tree, upload_tree

    from reelcache.cli import main

    r, manifest = root
    same_data(ddp_reference.parents[1], r)  # the uninterrupted run: the session's (auto: DDP on CPU)
    bucket, prefix = s3_server.shared_bucket, f"{secrets.token_hex(4)}/root"
    url, c = f"s3://{bucket}/{prefix}", s3_server.client()
    upload_tree(c, r / "latents/train", f"{url}/latents/train")
    upload_tree(c, manifest, f"{url}/manifests/train-0123456789abcdef.parquet")  # as `catalog manifest` names it
    env = {**slurm.env, **s3_server.env(), "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    mirror, eval_mirror = tmp_path / "mirror", tmp_path / "mirror-eval"  # the job's own (jobs.py: Place)
    name = "s3-requeued"
    p = submit(
        slurm, url, "--gpus-per-node=0", "--nproc-per-node=2", *data_args("train", *WHOLE), f"--run.name={name}",
        env={**env, "REELCACHE_S3_MIRROR": str(mirror)},
    )  # fmt: skip
    job, run = job_id(p), mirror / bucket / prefix / "runs" / name
    log = run / f"slurm/train-{name}-{job}.out"
    assert f"log {log} on the job's first node; checkpoint and stop: aws s3 cp /dev/null {url}/runs/{name}/stop;" in (
        p.stdout
    )
    script = (run / "slurm/train.sbatch").read_text()
    key = f"{prefix}/runs/{name}/slurm/train.sbatch"
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read().decode() == script  # beside the run, at once
    assert "AWS_" not in script and f"touch {run}/stop;" in script and "--output=/dev/null" in script
    ev = eval_serve(
        slurm, url, "train", f"runs/{name}", "--gpus-per-node", "1", "--after", job,
        env={**env, "REELCACHE_S3_MIRROR": str(mirror)},
    )  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    eval_job = ev.stdout.split("submitted job ")[1].split(":")[0]

    def has(key: str) -> bool:
        return c.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/runs/{name}/{key}")["KeyCount"] > 0

    wait_for(lambda: has("ckpt-00000004/state.json"), "the first checkpoint in S3", slurm, job, run)
    slurm.run("scontrol", "requeue", job)
    (record,) = slurm.wait(job, timeout=300)
    text = log.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, text[-3000:])
    assert "attempt 0" in text and "attempt 1" in text and "resumed from" in text, text[-3000:]
    (evaluated,) = slurm.wait(eval_job, timeout=240)
    eval_log = "".join(f.read_text() for f in (eval_mirror / bucket / prefix / "runs" / name / "slurm").glob("*.out"))
    assert evaluated["JobState"] == "COMPLETED", (evaluated, eval_log[-3000:])
    assert "the training job has ended and every checkpoint is evaluated" in eval_log, eval_log[-3000:]
    assert (run / "config.json").exists()  # the trainer's run folder is the one whose stop file the trap touches

    got = tmp_path / "got"
    keys = download_tree(c, f"{url}/runs/{name}", got)
    want = sorted(p.relative_to(ddp_reference).as_posix() for p in ddp_reference.glob("ckpt-*/**/*") if p.is_file())
    assert [k for k in keys if k.startswith("ckpt-")] == want  # every file of every checkpoint, nothing partial
    ckpts = sorted(d.name for d in ddp_reference.glob("ckpt-*"))
    assert len(ckpts) > 1 and all(f"{ckpt}/state.json" in keys for ckpt in ckpts)
    assert [k for k in keys if k.startswith("slurm/")] == ["slurm/eval.sbatch", "slurm/train.sbatch"], keys
    assert "run.lease" not in keys and "stop" not in keys
    same_run(ddp_reference, got, 15, which=("model", "ema"))
    assert max(row["generation"] for row in metrics(got).values()) == 1  # the second attempt trained the rest

    assert sorted(k.split("/")[1] for k in keys if k.endswith("/val_loss.json")) == ckpts
    ref = tmp_path / "ref/runs/whole"  # the reference's last checkpoint (read only: evaluated in a copy)
    shutil.copytree(ddp_reference / "ckpt-00000015", ref / "ckpt-00000015")
    common = ["--preset", "debug", "--device", "cpu", "--val-max-clips", "4", "--wandb-mode", "disabled"]
    argv = ["eval", "once", "--root", str(r), "--run", str(ref), "--val-manifest", str(manifest), *common]
    assert main([*argv, "--checkpoint", "ckpt-00000015"]) == 0
    rel = "eval/ckpt-00000015/val_loss.json"
    doc, want_doc = json.loads((got / rel).read_text()), json.loads((ref / rel).read_text())
    for k in ("global_step", "clips", "manifest_fingerprint", "weights", "overall", "buckets"):
        assert doc[k] == want_doc[k], k


def test_the_time_limits_warning_signal_checkpoints_and_requeues(slurm, root):
    """--time=1 (a minute) and the warning 40 s before it: the run checkpoints off its cadence (every
    1000 steps), exits 0, the script requeues the job and the next attempt resumes from there."""
    r, manifest = root
    args = data_args(manifest, "--run.epochs=200", "--checkpoint.every=1000", "--checkpoint.keep_last=10")
    p = submit(slurm, r, "--gpus-per-node=0", "--nproc-per-node=2", "--time=1", "--signal-s=40", *args, "--run.name=tl")
    job, run = job_id(p), r / "runs/tl"
    try:
        wait_for(lambda: "resumed from" in job_log(run), "the requeued attempt", slurm, job, run, timeout=300)
    finally:
        slurm.run("scancel", job, check=False)
    log = job_log(run)
    assert (
        "SIGUSR2 to the batch shell (the time limit is near" in log
        and "stopped on request at step" in log
        and "requeueing job" in log
    ), log[-3000:]
    (ckpt,) = [c for c in run.glob("ckpt-*") if int(c.name[5:]) % 1000]  # written at the signal, not the cadence
    step = json.loads((ckpt / "state.json").read_text())["global_step"]
    assert f"stopped on request at step {step}" in log and f"resumed from {ckpt}: step {step}" in log, log[-3000:]
    # consumed by the run that honoured it (unless the requeued attempt's own warning came before the scancel)
    assert not (run / "stop").exists() or log.count("SIGUSR2 to the batch shell") == 2, log[-3000:]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--partition=nope"], "partition 'nope' does not exist on this cluster (partitions: debug)"),
        (
            ["--gpus-per-node=64"],
            "--gpus-per-node 64 on 1 node(s): partition debug has 0 node(s) with 64 GPUs (at most 2 per node)",
        ),
        (["--nodes=3", "--gpus-per-node=1"], "--nodes 3: partition debug has 1 node(s)"),
        (["--gpus-per-node=0"], "--gpus-per-node 0 (CPU nodes): give --nproc-per-node, the ranks per node"),
    ],
)
def test_bad_resources_are_one_line_before_anything_is_submitted(slurm, root, args, message):
    r, manifest = root
    p = submit(slurm, r, *args, *data_args(manifest), "--run.name=bad", ok=False)
    assert p.returncode == 2 and p.stderr.strip() == f"reelcache: error: {message}", p.stderr
    assert not slurm.run("squeue", "--noheader", "--name=train-bad").stdout.strip()


def test_an_account_is_passed_on_unchecked_where_slurm_keeps_no_accounts(slurm, root):
    r, manifest = root
    p = submit(slurm, r, "--gpus-per-node=1", "--account=nobody", "--dry-run", *data_args(manifest), "--run.name=acc")
    assert (
        "accounting is off on this cluster" in p.stderr
        and "'nobody' cannot be checked" in p.stderr
        and "#SBATCH --account=nobody" in p.stdout
    )


def test_node_lists_expand_as_scontrol_does(slurm):
    for expr in ("gpu[01-03,7],cpu5", "n[001-002]-ib[1-2]", "a[8-11],b", slurm.node):
        want = slurm.run("scontrol", "show", "hostnames", expr).stdout.split()
        assert expand_nodelist(expr) == want, expr


def test_each_way_to_stop_does_what_the_readme_says(slurm, root):
    """`scancel --signal=USR2 <job>` reaches every process of the job's step: the ranks checkpoint and stop,
    torchrun (started with USR2 ignored) lives on, and the job ends COMPLETED, not requeued. The same
    command again resumes there; `scancel --batch --signal=USR2 <job>` (the batch shell's trap) checkpoints,
    stops and requeues; the stop file then stops the requeued attempt for good."""
    r, manifest = root
    args = data_args(manifest, "--run.epochs=200", "--checkpoint.every=1000", "--checkpoint.keep_last=10")
    resources = ("--gpus-per-node=0", "--nproc-per-node=2")
    run = r / "runs/stops"
    p = submit(slurm, r, *resources, *args, "--run.name=stops")
    job = job_id(p)
    assert (
        f"checkpoint and stop: touch {run}/stop; checkpoint, stop and requeue: scancel --batch --signal=USR2 {job}"
        in (p.stdout)
    )
    log = run / f"slurm/train-stops-{job}.out"
    wait_for(lambda: " step 2/" in text_of(log), "training steps", slurm, job, run)  # (pending: no log yet)
    slurm.run("scancel", "--signal=USR2", job)
    (record,) = slurm.wait(job, timeout=120)
    text = log.read_text()
    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "0", "0:0"), (record, text)
    first = int(text.split("stopped on request at step ")[1].split()[0])
    assert (run / f"ckpt-{first:08d}/state.json").exists() and "requeueing" not in text

    p = submit(slurm, r, *resources, *args, "--run.name=stops")  # the same command again: it resumes
    job = job_id(p)
    log = run / f"slurm/train-stops-{job}.out"
    wait_for(lambda: f" step {first + 2}/" in text_of(log), "steps after the resume", slurm, job, run)
    assert f"resumed from {run}/ckpt-{first:08d}: step {first}" in log.read_text()
    slurm.run("scancel", "--batch", "--signal=USR2", job)
    wait_for(lambda: log.read_text().count("resumed from") == 2, "the requeued attempt", slurm, job, run)
    (run / "stop").touch()
    (record,) = slurm.wait(job, timeout=120)
    text = log.read_text()
    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0"), (record, text)
    assert "SIGUSR2 to the batch shell" in text and text.count("stopped on request at step") == 2, text[-3000:]
    second = int(text.split("stopped on request at step ")[1].split()[0])
    assert f"resumed from {run}/ckpt-{second:08d}: step {second}" in text and not (run / "stop").exists()


@pytest.mark.parametrize("case", ["time", "cpus", "cpus-verbatim", "manifest", "root"])
def test_bad_inputs_are_one_line_before_anything_is_submitted(slurm, root, tmp_path, case):
    r, manifest = root
    args = data_args(manifest)
    if case == "time":
        args, message = ["--time=5", "--signal-s=300", *args], "--time 5 (300 s) is not longer than --signal-s 300:"
    elif case == "cpus":
        args = ["--cpus-per-task=999", *args]
        message = f"--cpus-per-task 999: no node of partition debug has more than {slurm.cpus} CPUs"
    elif case == "cpus-verbatim":
        args = ["--sbatch-arg=--cpus-per-task=999", *args]
        message = f"--sbatch-arg=--cpus-per-task 999: no node of partition debug has more than {slurm.cpus} CPUs"
    elif case == "manifest":
        args, message = data_args(Path("absent")), "data.manifests: no manifest 'absent'"
    else:  # a root where runs/<run>/slurm cannot be made
        r = tmp_path
        (r / "runs").write_text("")
        message = f"cannot write the job script {r}/runs/bad/slurm/train.sbatch: "
    p = submit(slurm, r, "--gpus-per-node=1", *args, "--run.name=bad", ok=False)
    assert p.returncode == 2 and p.stderr.startswith(f"reelcache: error: {message}"), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert not slurm.run("squeue", "--noheader", "--name=train-bad").stdout.strip()


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "nothing to evaluate: give --prompts and/or --val-manifest"),
        (["--val-manifest", "absent"], "--val-manifest: no manifest 'absent'"),
    ],
)
def test_eval_serve_without_inputs_is_one_line_before_anything_is_submitted(slurm, root, args, message):
    r, _ = root
    cmd = [sys.executable, "-m", "reelcache", "eval", "serve", "--root", str(r), "--run", "runs/x", *args, "--slurm"]
    p = subprocess.run(cmd, env=slurm.env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith(f"reelcache: error: {message}"), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr


def test_s3_root_inputs_are_one_line_before_anything_is_submitted(slurm, s3_server, tmp_path):
    """A root in S3: a training manifest the root's manifests/ lacks (looked for in the mirror, as the trainer
    does) and an evaluation of a run with neither its config.json nor a submitted training are one line; nothing
    is submitted and nothing is put in S3."""
    import secrets

    url = f"s3://{s3_server.shared_bucket}/{secrets.token_hex(4)}/root"
    env = {**slurm.env, **s3_server.env(), "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    env["REELCACHE_S3_MIRROR"] = str(tmp_path / "mirror")
    p = submit(slurm, url, "--gpus-per-node=1", *data_args("absent"), "--run.name=bad", ok=False, env=env)
    assert p.returncode == 2 and p.stderr.startswith("reelcache: error: data.manifests: no manifest 'absent'")
    cmd = [sys.executable, "-m", "reelcache", "eval", "serve", "--root", url, "--run", "runs/bad", "--slurm"]
    p = subprocess.run([*cmd, "--val-manifest", "v"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr == (
        f"reelcache: error: no run at {url}/runs/bad (no config.json under it, no training submitted there)\n"
    )
    assert not slurm.run("squeue", "--noheader", "--name=train-bad,eval-bad").stdout.strip()
    bucket, prefix = url[5:].split("/", 1)
    assert s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["KeyCount"] == 0


def test_no_controller_is_said_in_one_line(slurm, root, tmp_path):
    """A slurm.conf whose controller port nobody listens on: said as that, not as a missing partition."""
    r, manifest = root
    conf = tmp_path / "slurm.conf"
    text = re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={free_port()}", slurm.conf.read_text())
    conf.write_text(text + "MessageTimeout=2\n")  # the clients retry a silent controller this long (10 s default)
    env = {**slurm.env, "SLURM_CONF": str(conf)}
    train_cmd = [sys.executable, "-m", "reelcache", "train", CONFIG, "--root", str(r), *data_args(manifest)]
    units = [sys.executable, "-m", "reelcache", "slurm", "submit", "--partition", "debug", "--dir", str(tmp_path / "j")]
    for cmd, given in ((train_cmd + ["--slurm", "--gpus-per-node=1"], None), (units + ["--", "true"], "a\n")):
        p = subprocess.run(cmd, env=env, cwd=REPO, input=given, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith("reelcache: error: no Slurm controller answers ("), p.stderr
        assert p.stderr.count("\n") == 1 and f"is {conf} this cluster's?" in p.stderr, p.stderr
