"""The Slurm option set and the job scripts rendered from it, without a cluster (cluster/slurm/).

Every command that submits (``slurm submit``, ``train --slurm``, ``eval serve --slurm``) is read by
the real top-level parser; the scripts are compared with directives written out by hand, and the
time limits with man sbatch's rules (tests/cluster/test_slurm_array.py and test_slurm_train.py submit
the same scripts to a real Slurm).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from support import REPO

from reelcache import UserError
from reelcache.cli import build_parser
from reelcache.cluster.slurm import array, checks, jobs, options, script
from reelcache.cluster.slurm.client import partition_fields

SHARED = ["--partition", "--account", "--time", "--mem", "--cpus-per-task", "--job-name", "--sbatch-arg", "--dry-run"]
TRAIN = ["train", str(REPO / "configs/train/debug/stage1.toml"), "--root", str(REPO), "--slurm"]
EVAL = ["eval", "serve", "--root", str(REPO), "--run", "runs/x", "--slurm"]
SUBMIT = ["slurm", "submit"]


def _options(*words: str) -> dict[str, str]:
    """Each option string of a subcommand's parser and the help it shows (the parser build_parser makes)."""
    p = build_parser()
    for w in words:
        p = next(a for a in p._actions if a.choices and w in a.choices).choices[w]
    return {o: a.help for a in p._actions for o in a.option_strings}


def test_every_command_that_submits_takes_the_same_options():
    seen = [_options("slurm", "submit"), _options("train"), _options("eval", "serve")]
    for opts in seen:
        assert set(SHARED) <= set(opts)
    for o in SHARED:  # one definition: the same help everywhere but the job name's default
        if o != "--job-name":
            assert len({opts[o] for opts in seen}) == 1, o
    assert "--gpus-per-task" in seen[0] and "--nodes" in seen[1] and "--after" in seen[2]
    assert {opts["--sbatch"] for opts in seen} == {argparse.SUPPRESS}  # the old spelling, hidden


def test_the_old_spelling_is_refused_in_one_line_naming_the_option(capsys):
    """--sbatch (renamed --sbatch-arg) is refused, not taken as an abbreviation of --sbatch-arg (docs/CHANGELOG.md)."""
    for argv in (TRAIN, EVAL, [*SUBMIT, "--partition", "p"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_known_args([*argv, "--sbatch-arg=--qos=high", "--sbatch=--exclusive", "--", "true"])
        assert e.value.code == 2
        assert (
            capsys.readouterr()
            .err.splitlines()[-1]
            .endswith("error: argument --sbatch: is no option any more: write --sbatch-arg=OPT")
        )
    a, _ = build_parser().parse_known_args([*TRAIN, "--sbatch-arg=--qos=high"])
    assert a.sbatch_arg == ["--qos=high"] and capsys.readouterr().err == ""


def test_the_options_read_back_as_resources():
    a, _ = build_parser().parse_known_args(
        [*TRAIN, "--partition=h100", "--nodes=20-24", "--gpus-per-node=8", "--time=2-00:00:00", "--mem=400G"]
        + ["--cpus-per-task=96", "--account=vision", "--job-name=s1", "--sbatch-arg=--qos=high"]
    )
    res = options.resources(a)
    assert res == options.Resources(
        partition="h100", account="vision", time="2-00:00:00", mem="400G", cpus_per_task=96, job_name="s1",
        sbatch_args=("--qos=high",), nodes=24, min_nodes=20, gpus_per_node=8,
    )  # fmt: skip
    assert res.node_range == "20-24"
    assert res.directives() == [
        *("--partition=h100", "--account=vision", "--time=2-00:00:00", "--mem=400G", "--cpus-per-task=96"),
        *("--gpus-per-node=8", "--qos=high"),
    ]


def test_a_training_script_has_the_directives_written_out_by_hand(tmp_path):
    res = options.Resources(partition="h100", time="2-00:00:00", nodes=24, min_nodes=20, gpus_per_node=8)
    job = jobs.train_script("c.toml", tmp_path, "s1", res, nproc=8, signal_s=300, train_args=["--optim.lr=1e-4"])
    folder = tmp_path / "runs/s1/slurm"
    assert (job.script, job.name, job.log("42")) == (folder / "train.sbatch", "train-s1", folder / "train-s1-42.out")
    lines = job.text.splitlines()
    assert lines[0] == "#!/bin/bash" and lines[1].startswith(
        "# training run s1, written by `reelcache train --slurm` at"
    )
    assert lines[2] == f"# Submit it again by hand with: sbatch {folder}/train.sbatch"
    assert [x for x in lines if x.startswith("#SBATCH")] == [
        "#SBATCH --job-name=train-s1",
        "#SBATCH --nodes=20-24",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR2@300",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={folder}/%x-%j.out",
        "#SBATCH --partition=h100",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --gpus-per-node=8",
    ]
    assert "--nproc_per_node=8" in job.text and "--optim.lr=1e-4" in job.text and "--resume --wait" in job.text


def test_an_eval_script_runs_eval_serve_without_its_slurm_options(tmp_path):
    argv = ["--root", "R", "--run", "runs/x", "--slurm", "--partition", "gpu", "--after=7", "--gpus-per-node", "1"]
    argv += ["--sbatch-arg", "--qos=high", "--val-manifest", "v", "--dry-run"]
    args = options.without_slurm_options(argv, "eval")
    assert args == ["--root", "R", "--run", "runs/x", "--val-manifest", "v"]
    job = jobs.eval_script(tmp_path, "runs/x", options.Resources(gpus_per_node=1), after="7", args=args, python="py")
    assert [x for x in job.text.splitlines() if x.startswith("#SBATCH")] == [
        "#SBATCH --job-name=eval-x",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={tmp_path}/runs/x/slurm/%x-%j.out",
        "#SBATCH --dependency=after:7",
        "#SBATCH --gpus-per-node=1",
    ]
    assert job.text.endswith("exec py -m reelcache eval serve --root R --run runs/x --val-manifest v\n")


def test_jobs_over_an_s3_root_keep_their_folder_in_the_mirror_and_the_script_beside_the_run(tmp_path, monkeypatch):
    """No shared file system (cluster/slurm/jobs.py): the script in the submitter's mirror and uploaded beside the
    run; the job exports that mirror (the evaluation job a mirror of its own), makes its log's folder there on the
    node and opens the log itself (Slurm's --output is /dev/null); the trap's stop file is the node's run folder's;
    no credential is written."""
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "m"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    root, res = "s3://bkt/p/root", options.Resources(gpus_per_node=8)
    job = jobs.train_script("c.toml", root, "s1", res, nproc=8, signal_s=300, train_args=[])
    run = tmp_path / "m/bkt/p/root/runs/s1"
    assert (job.script, str(job.remote), job.log("42")) == (
        run / "slurm/train.sbatch",
        f"{root}/runs/s1/slurm/train.sbatch",
        run / "slurm/train-s1-42.out",
    )
    lines = job.text.splitlines()
    assert "#SBATCH --output=/dev/null" in lines and "s3cret" not in job.text
    body = lines[lines.index("set -uo pipefail") + 1 :]
    assert body[:2] == [
        f"export REELCACHE_S3_MIRROR={tmp_path}/m",
        f'mkdir -p {run}/slurm && exec >>{run}/slurm/"$SLURM_JOB_NAME-$SLURM_JOB_ID.out" 2>&1 || exit 1',
    ]
    assert f"touch {run}/stop; requeue=1" in job.text and f"--root {root} --resume --wait" in job.text

    ev = jobs.eval_script(root, "runs/s1", options.Resources(gpus_per_node=1), after="7", args=["--root", root])
    theirs = tmp_path / "m-eval/bkt/p/root/runs/s1"
    assert (ev.script, str(ev.remote), ev.log("43")) == (
        run / "slurm/eval.sbatch",
        f"{root}/runs/s1/slurm/eval.sbatch",
        theirs / "slurm/eval-s1-43.out",
    )
    assert f"export REELCACHE_S3_MIRROR={tmp_path}/m-eval\nmkdir -p {theirs}/slurm && exec >>" in ev.text


def test_an_array_script_and_its_then_job_have_the_directives_written_out_by_hand(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = build_parser().parse_args(
        [*SUBMIT, "--partition", "gpu", "--gpus-per-task", "1", "--max-running", "4", "--mem", "16G"]
        + ["--then", "reelcache catalog merge --root R", "--", "reelcache", "cache", "run", "--root", "R"]
    )
    req = array.request(a, ["u0", "u1", "u2"])
    one, then = array.render(req, tmp_path / "job", "rc-cache-run")
    out = tmp_path / "job/logs"
    head = [f"--output={out}/%A_%a.out", "--open-mode=append", f"--chdir={tmp_path}", "--ntasks=1"]
    assert [x[8:] for x in one.splitlines() if x.startswith("#SBATCH")] == [
        "--job-name=rc-cache-run", *head, "--array=0-2%4", "--requeue", "--partition=gpu", "--mem=16G",
        "--gpus-per-task=1",
    ]  # fmt: skip
    assert '\nreelcache cache run --root R "$unit"\n' in one and "\ndir=" + str(tmp_path / "job") + "\n" in one
    head[0] = f"--output={out}/then-%j.out"
    assert [x[8:] for x in then.splitlines() if x.startswith("#SBATCH")] == [
        "--job-name=rc-cache-run-then", *head, "--partition=gpu", "--mem=16G"  # the merge takes no GPU
    ]  # fmt: skip
    assert (
        then.splitlines()[2]
        == f"# Submit it again by hand with: sbatch --dependency=afterany:<array job id> {tmp_path}/job/then.sbatch"
    )


def test_a_directive_with_a_space_is_refused_in_one_line():
    with pytest.raises(
        UserError, match=r"^#SBATCH --output=/a b/x: a value with a space cannot be an sbatch directive"
    ):
        script.render(what="w", command="c", again="a", directives=["--output=/a b/x"], body="")


def test_the_failed_units_command_asks_for_what_the_first_submit_asked(tmp_path):
    """The then job's "run them again" line, parsed by the CLI's own parser, is the first submit's
    arguments (a GPU unit run again without --gpus-per-task would get no GPU) with --units failed.txt."""
    first = [
        *(*SUBMIT, "--partition", "gpu", "--account", "proj", "--max-running", "4", "--retries", "2"),
        *("--time", "2:00:00", "--cpus-per-task", "8", "--gpus-per-task", "1", "--mem", "16G", "--job-name", "c"),
        *("--sbatch-arg=--qos=high", "--sbatch-arg=--exclusive", "--then", "reelcache catalog merge --root 'R x'"),
        *("--no-command-check", "--", "reelcache", "cache", "run", "--root", "R x"),
    ]
    a = build_parser().parse_args(first)
    again = shlex.split(array.again_command(array.request(a, ["u"]), tmp_path))
    assert again[0] == "reelcache"
    b = build_parser().parse_args(again[1:])
    assert b.units == str(tmp_path / "failed.txt")
    same = ("partition", "account", "max_running", "retries", "time", "cpus_per_task", "gpus_per_task", "mem")
    same += ("job_name", "sbatch_arg", "then", "no_command_check", "command")
    assert {k: getattr(b, k) for k in same} == {k: getattr(a, k) for k in same}
    # defaults stay defaults
    plain = array.Request(command=["true"], units=["u"], res=options.Resources(partition="debug"))
    assert shlex.split(array.again_command(plain, tmp_path)) == [
        *("reelcache", "slurm", "submit", "--partition", "debug", "--units", str(tmp_path / "failed.txt"), "--", "true")
    ]


def test_a_command_that_exists_only_on_the_nodes_is_looked_for_unless_told_not_to():
    a = build_parser().parse_args([*SUBMIT, "--", "/nodes/only/bin/tool", "--x"])
    req = array.request(a, ["u"])
    assert (req.command, req.command_check) == (["/nodes/only/bin/tool", "--x"], True)
    with pytest.raises(UserError, match=r"^command '/nodes/only/bin/tool' not found here .* or --no-command-check"):
        checks.check_command(req.command)
    b = build_parser().parse_args([*SUBMIT, "--no-command-check", "--", "/nodes/only/bin/tool", "--x"])
    assert array.request(b, ["u"]).command_check is False


def test_time_limits_are_read_as_sbatch_reads_them():
    """man sbatch: "Time resolution is one minute and second values are rounded up to the next minute.
    A time limit of zero requests that no time limit be imposed." (expected values by hand)"""
    cases = {"90": 5400, "0:30": 60, "2:30": 180, "1:00:01": 3660, "2-0": 172800, "1-2:3": 93780,
             "1-0:0:1": 86460, "0": None, "0:0:0": None, "UNLIMITED": None, " infinite ": None}  # fmt: skip
    assert {v: checks.time_seconds(v) for v in cases} == cases
    checks.check_time("0", 300)  # no limit: nothing to refuse
    checks.check_time("0:30", 40)  # a 1-minute limit, 40 s warning: what the time-limit test submits
    with pytest.raises(UserError, match=r"^--time 5 \(300 s\) is not longer than --signal-s 300"):
        checks.check_time("5", 300)
    with pytest.raises(UserError, match=r"^--time soon: not a Slurm time"):
        checks.time_seconds("soon")


# `scontrol show partition --oneliner` as Slurm 22.05 prints it (fields abridged), by hand.
PARTITION = (
    "PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A "
    "DefaultTime=00:04:00 DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=01:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=gpu[01-04] PriorityJobFactor=1 "
    "State=UP TotalCPUs=256 TotalNodes=4"
)


def test_without_a_time_the_partitions_default_time_is_checked_against_the_signal():
    fields = partition_fields(PARTITION)
    assert (fields["DefaultTime"], fields["MaxTime"], fields["State"]) == ("00:04:00", "01:00:00", "UP")
    with pytest.raises(UserError) as e:
        checks.check_default_time("short", fields, 300)
    assert str(e.value).startswith(
        "no --time: partition short's DefaultTime 00:04:00 (240 s) is not longer than --signal-s 300: "
    )
    checks.check_default_time("short", fields, 200)
    no_default = partition_fields(PARTITION.replace("DefaultTime=00:04:00", "DefaultTime=NONE"))
    checks.check_default_time("short", no_default, 300)  # MaxTime, an hour, is long enough
    with pytest.raises(UserError, match=r"^no --time: partition short's MaxTime 01:00:00 \(3600 s\)"):
        checks.check_default_time("short", no_default, 3600)
    unlimited = PARTITION.replace("DefaultTime=00:04:00", "DefaultTime=NONE").replace("01:00:00", "UNLIMITED")
    checks.check_default_time("short", partition_fields(unlimited), 10**6)


@pytest.mark.skipif(
    not shutil.which("scontrol") or os.path.exists("/etc/slurm/slurm.conf"), reason="needs Slurm's clients, no config"
)
def test_no_slurm_configuration_is_said_as_that(tmp_path):
    """Issue 30.5: where scontrol finds no slurm.conf ("Could not establish a configuration source"), submit says
    so in one line, not that partition 'debug' does not exist."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    cmd = [sys.executable, "-m", "reelcache", "slurm", "submit", "--partition", "debug", "--dir", str(tmp_path / "j")]
    p = subprocess.run(
        [*cmd, "--", "true"], env=env, cwd=REPO, input="a\n", capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.splitlines() == [
        "reelcache: error: no Slurm configuration (scontrol: fatal: Could not establish a configuration source): no "
        "slurm.conf here and SLURM_CONF is unset; run this on a node of the cluster (a login node), or export "
        "SLURM_CONF=<the cluster's slurm.conf>"
    ], p.stderr
    assert not (tmp_path / "j").exists()
