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

Checks before submitting: checks.py; the stages check their own inputs (train: the manifests; eval:
something to evaluate).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

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
    """A job script, rendered: where it goes, its text and the job's name (its log is ``<name>-<job id>.out``)."""

    script: Path
    text: str
    name: str

    def log(self, job_id: str) -> Path:
        return self.script.parent / f"{self.name}-{job_id}.out"


def _inner(text: str) -> str:
    """``text`` quoted for the shell, inside a single-quoted ``bash -c '...'``."""
    return shlex.quote(text).replace("'", "'\"'\"'")


def train_script(
    config: str,
    root: Path,
    run: str,
    res: Resources,
    *,
    nproc: int,
    signal_s: int,
    train_args: list[str],
    python: str = sys.executable,
) -> Job:
    """The training job's script, written under ``runs/<run>/slurm/``."""
    run_dir = root / "runs" / run
    folder = run_dir / "slurm"
    path = folder / "train.sbatch"
    name = res.job_name or f"train-{run}"
    args = [str(Path(config).resolve()), "--root", str(root), "--resume", "--wait", f"--run.name={run}", *train_args]
    directives = [
        f"--job-name={name}",
        f"--nodes={res.node_range}",  # no task count (it would pin --nodes MIN-MAX to MIN): srun starts one per node
        "--requeue",
        f"--signal=B:USR2@{signal_s}",
        "--open-mode=append",
        f"--output={folder}/%x-%j.out",
        *res.directives(),
    ]
    body = TRAIN_BODY.format(
        python=_inner(python),
        nproc=nproc,
        stop=_inner(str(run_dir / "stop")),
        args=" ".join(_inner(a) for a in args),
    )
    text = script.render(
        what=f"training run {run}", command="train --slurm", again=str(path), directives=directives, body=body
    )
    return Job(path, text, name)


def eval_script(
    run_dir: Path, res: Resources, *, after: str | None, args: list[str], python: str = sys.executable
) -> Job:
    """An evaluation server job beside a training run: one task, ``eval serve ARGS``."""
    folder = run_dir / "slurm"
    path = folder / "eval.sbatch"
    name = res.job_name or f"eval-{run_dir.name}"
    directives = [
        f"--job-name={name}",
        f"--nodes={res.node_range}",
        "--ntasks=1",
        "--requeue",
        "--open-mode=append",
        f"--output={folder}/%x-%j.out",
        *([f"--dependency=after:{after}"] if after else []),
        *res.directives(),
    ]
    cmd = [python, "-m", "reelcache", "eval", "serve", *args]
    body = "export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1\nexec " + shlex.join(cmd) + "\n"
    text = script.render(
        what=f"evaluation of {run_dir.name}",
        command="eval serve --slurm",
        again=str(path),
        directives=directives,
        body=body,
    )
    return Job(path, text, name)


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
    return script.sbatch(job.script)
