"""Training and evaluation as Slurm batch jobs, rendered from the one template (script.py) and checked first.

    reelcache train configs/train/opensora12/stage1.toml --root /data/rc --init-from /weights/PixArt.pth \
        --slurm --partition h100 --nodes 24 --gpus-per-node 8 --time 2-00:00:00
    reelcache eval serve --root /data/rc --run runs/os12-stage1 ... --slurm --partition h100 --after 4242

The jobs are shell (``srun`` starting one ``torchrun`` per node); the script is kept beside the run
(``runs/<run>/slurm/``), to read, keep and ``sbatch`` again.

Training. One job of N nodes (or ``--nodes MIN-MAX``: Slurm starts it, and every requeue of it, on
as many nodes as are up, at least MIN, and the ranks follow ``SLURM_NNODES``); ``srun`` starts one
``torchrun`` per node (``--node_rank`` = ``SLURM_NODEID``, the master address the first host of
``scontrol show hostnames $SLURM_JOB_NODELIST``, a port derived from the job id), so the ranks are
the same on every attempt on the same nodes.
The trainer always runs with ``--resume``: the first attempt starts the run (from ``--init-from``
if given), every later one continues from the run's newest checkpoint in the same run directory
and the same wandb run, with ``--wait``: a requeued attempt may start while its predecessor's ranks
are still exiting, and waits for the run directory's lease (train/runlease.py) instead of failing.
Attempts come from three places:

- ``#SBATCH --requeue``: Slurm requeues the job after a node failure or a preemption (the run loses
  the steps since its newest checkpoint, at most ``checkpoint.every``);
- a stop-and-requeue: ``--signal=B:USR2@<s>`` makes Slurm signal the batch shell ``s`` seconds before
  the time limit, and ``scancel --batch --signal=USR2 <job>`` does the same by hand; the shell's trap
  writes ``runs/<run>/stop`` (every node sees the run directory), the trainer checkpoints at the next
  step on all ranks and exits 0, and the script requeues its own job (``scontrol requeue``), which
  continues where it stopped;
- ``scontrol requeue <job>`` by hand: the ranks are killed at once, losing the steps since the
  newest checkpoint.

Two ways only stop (checkpoint at the next step, the job ends COMPLETED, nothing requeued):
``touch runs/<run>/stop``, and ``scancel --signal=USR2 <job>``, which signals every process of the
job's steps, not the batch shell. torchrun would die of that signal (its default action), so the
script starts it with USR2 ignored; the ranks install their own handler (a signal that arrives
before a rank's first step is ignored; the stop file is read at every step).

Every attempt appends to the same log, ``runs/<run>/slurm/<job name>-<job id>.out``.

A root in S3 (``--root s3://bucket/prefix``, docs/STORAGE.md "A run in S3"): no file system is shared, so
the run folder is the root's local mirror (``<mirror>/<bucket>/<prefix>/runs/<run>/``) on each machine.
The script is written there on the submitting machine and uploaded beside the run
(``runs/<run>/slurm/train.sbatch``, an object: ``eval serve`` finds the run from the moment it is
submitted). The job exports that mirror (``REELCACHE_S3_MIRROR``) to every node, so each node's run folder
is at the path the script names; the batch shell makes the log's folder there, on the job's first node
(where rank 0 runs), and appends every attempt on that node to the log (Slurm's own ``--output`` is
/dev/null: Slurm opens it before the script could make the folder). The trap's stop file is the local one
of that node's run folder, which rank 0 reads at every step as on a shared root; a stop by hand is the
object ``runs/<run>/stop``. The credentials reach the job as the rest of the submitter's environment
does (sbatch's default ``--export=ALL``); none is written into the script. An evaluation job keeps a
mirror of its own (``<mirror>-eval``): on a node it shares with the training, the two would otherwise
download the same checkpoint into one folder and each remove it after use.

Checks before submitting: checks.py; the stages check their own inputs (train: the manifests; eval:
something to evaluate).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.base import s3
from reelcache.cluster.slurm import checks, script
from reelcache.cluster.slurm.client import answers
from reelcache.cluster.slurm.options import Resources
from reelcache.log import say

TRAIN_BODY = """export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
requeue=0
trap 'echo "$(date +%T) slurm: SIGUSR2 to the batch shell (the time limit is near, or scancel --batch):" \\
"the run checkpoints at its next step and the job is requeued"; touch {stop}; requeue=1' USR2
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))
echo "$(date +%T) slurm: job $SLURM_JOB_ID attempt ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap "" USR2; exec {python} -m torch.distributed.run \\
    --nnodes="$SLURM_NNODES" --node_rank="$SLURM_NODEID" --nproc_per_node={nproc} \\
    --master_addr='"$head"' --master_port='"$port"' -m reelcache train {args}' &
step=$!
while true; do
    wait "$step"
    status=$?
    kill -0 "$step" 2>/dev/null || break   # wait returns early when the trap runs: the step goes on
done
if [ "$requeue" = 1 ] && [ "$status" = 0 ]; then
    echo "$(date +%T) slurm: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


@dataclass
class Job:
    """A job script, rendered: where it goes, its text and the job's name (its log is ``<name>-<job id>.out``, in
    ``logs``: the script's folder, or for a run in S3 that folder of the job's mirror, on the job's first node);
    ``remote``: the object the script is uploaded to (a run in S3)."""

    script: Path
    text: str
    name: str
    logs: Path
    remote: s3.Url | None = None

    def log(self, job_id: str) -> Path:
        return self.logs / f"{self.name}-{job_id}.out"


@dataclass
class Place:
    """Where a job of run ``rel`` (``runs/<run>``) keeps its files. A folder root: the run folder, its
    ``slurm/`` (the script and Slurm's ``--output``), one path for every machine. A root in S3: the run
    folder in the submitting machine's mirror (the script), the run's prefix (the script's object), and the
    mirror the job exports to its nodes (``job_mirror``), under which the batch shell makes the log's folder."""

    run_dir: Path  # here (the script)
    job_run_dir: Path  # on the job's nodes (the stop file, the log)
    remote: s3.Url | None = None
    job_mirror: Path | None = None

    @classmethod
    def of(cls, root, rel: str, *, mirror_suffix: str = "") -> Place:
        if not s3.is_url(root):
            run_dir = (Path(root) / rel).resolve()
            return cls(run_dir, run_dir)
        url = s3.parse(root)
        base = s3.mirror_dir(s3.Url(url.bucket)).parent.resolve()  # $REELCACHE_S3_MIRROR, or its default
        job_mirror = Path(f"{base}{mirror_suffix}")
        return cls(base / url.bucket / url.key / rel, job_mirror / url.bucket / url.key / rel, url / rel, job_mirror)

    def output(self) -> str:
        """The ``--output`` directive's value: the log itself, or /dev/null where the shell makes it (S3)."""
        return "/dev/null" if self.remote is not None else f"{self.run_dir}/slurm/%x-%j.out"

    def prologue(self) -> str:
        """The script's first lines: for a run in S3, the job's mirror exported and its log opened there."""
        if self.remote is None:
            return ""
        logs = self.job_run_dir / "slurm"
        return (
            f"export REELCACHE_S3_MIRROR={shlex.quote(str(self.job_mirror))}\n"
            f"mkdir -p {shlex.quote(str(logs))} && "
            f'exec >>{shlex.quote(str(logs))}/"$SLURM_JOB_NAME-$SLURM_JOB_ID.out" 2>&1 || exit 1\n'
        )

    def job(self, script_name: str, text: str, name: str) -> Job:
        remote = self.remote / "slurm" / script_name if self.remote is not None else None
        return Job(self.run_dir / "slurm" / script_name, text, name, self.job_run_dir / "slurm", remote)


def _inner(text: str) -> str:
    """``text`` quoted for the shell, inside a single-quoted ``bash -c '...'``."""
    return shlex.quote(text).replace("'", "'\"'\"'")


def train_script(
    config: str,
    root: Path | str,
    run: str,
    res: Resources,
    *,
    nproc: int,
    signal_s: int,
    train_args: list[str],
    python: str = sys.executable,
) -> Job:
    """The training job's script, written under ``runs/<run>/slurm/`` (a root in S3: of its mirror here)."""
    place = Place.of(root, f"runs/{run}")
    name = res.job_name or f"train-{run}"
    args = [str(Path(config).resolve()), "--root", str(root), "--resume", "--wait", f"--run.name={run}", *train_args]
    directives = [
        f"--job-name={name}",
        f"--nodes={res.node_range}",  # no task count (it would pin --nodes MIN-MAX to MIN): srun starts one per node
        "--requeue",
        f"--signal=B:USR2@{signal_s}",
        "--open-mode=append",
        f"--output={place.output()}",
        *res.directives(),
    ]
    body = place.prologue() + TRAIN_BODY.format(
        python=_inner(python),
        nproc=nproc,
        stop=_inner(str(place.job_run_dir / "stop")),
        args=" ".join(_inner(a) for a in args),
    )
    path = place.run_dir / "slurm/train.sbatch"
    text = script.render(
        what=f"training run {run}", command="train --slurm", again=str(path), directives=directives, body=body
    )
    return place.job("train.sbatch", text, name)


def eval_script(
    root: Path | str, rel: str, res: Resources, *, after: str | None, args: list[str], python: str = sys.executable
) -> Job:
    """An evaluation server job beside the training run ``rel`` (``runs/<run>``, or a path) of ``root``: one
    task, ``eval serve ARGS``; for a run in S3 with a mirror of its own (``<mirror>-eval``: module docstring)."""
    place = Place.of(root, rel, mirror_suffix="-eval")
    name = res.job_name or f"eval-{place.run_dir.name}"
    directives = [
        f"--job-name={name}",
        f"--nodes={res.node_range}",
        "--ntasks=1",
        "--requeue",
        "--open-mode=append",
        f"--output={place.output()}",
        *([f"--dependency=after:{after}"] if after else []),
        *res.directives(),
    ]
    cmd = [python, "-m", "reelcache", "eval", "serve", *args]
    body = place.prologue() + "export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1\nexec " + shlex.join(cmd) + "\n"
    text = script.render(
        what=f"evaluation of {place.run_dir.name}",
        command="eval serve --slurm",
        again=str(place.run_dir / "slurm/eval.sbatch"),
        directives=directives,
        body=body,
    )
    return place.job("eval.sbatch", text, name)


def launch(job: Job, res: Resources, *, dry_run: bool = False, signal_s: int | None = None) -> str | None:
    """Check the resources, write the script and submit it; its job id. A dry run prints it instead
    (checked too where a cluster answers ``sinfo``)."""
    if not dry_run or answers():
        for warning in checks.check(res, signal_s=signal_s):
            say(f"warning: {warning}")
    script.write(job.script, job.text)
    if dry_run:
        print(job.text, end="")
        return None
    if job.remote is not None:  # beside the run in S3 before the job can start (eval serve finds the run by it)
        try:
            s3.upload_file(job.script, job.remote)
        except s3.S3Error as e:
            raise UserError(f"cannot upload the job script: {e}") from None
    return script.sbatch(job.script)
