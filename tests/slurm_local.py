"""A one-node Slurm on this machine that a test starts and stops: Debian's munged, slurmctld and
slurmd (``apt-get install slurm-wlm munge``), run as root, everything in one directory.

    with local_slurm(tmp_path / "slurm") as slurm:   # SlurmUnavailable(reason) when it cannot start
        subprocess.run(["sbatch", "--wait", "--wrap", "hostname"], env=slurm.env, check=True)

    @pytest.fixture(scope="module")
    def slurm(tmp_path_factory):
        with local_slurm_or_skip(tmp_path_factory.mktemp("slurm")) as cluster:  # skips, naming what is missing
            yield cluster

    .venv/bin/python tests/slurm_local.py up [DIR]   # by hand: prints `export SLURM_CONF=...`; Ctrl-C stops it

The directory holds the munge key and socket, slurm.conf and gres.conf, the controller's state,
slurmd's spool, the logs and the fake GPUs; the ports are free ones picked at start. No systemd, no
accounting database (``sacct`` has nothing; ``scontrol show job`` keeps a finished job for
``MinJobAge``, 300 s), no cgroups (``proctrack/linuxproc``, ``task/none``).

Teardown. slurmd starts each job's slurmstepd detached (a double fork), so stopping the daemons
would leave running jobs behind. The daemons are children of a supervisor (this file run as
``supervise DIR``) that makes itself the child subreaper (``prctl``): every process the cluster
starts, detached or not, stays its descendant. When its stdin closes (``stop()``, or the test
process dying) or on SIGTERM, it SIGKILLs all its descendants until none is left, and exits. It
also exits, the same way, when a daemon dies. ``stop()`` then checks that no process still has
the cluster's directory in its command line or environment (every daemon and job has, through
``SLURM_CONF``) and kills any by pid.

Settings chosen for tests (each is a keyword of ``LocalSlurm``):

- one node named as this host (``hostname -s``, address 127.0.0.1), ``CPUs`` from ``os.cpu_count()``,
  ``RealMemory`` 90% of MemTotal (more than slurmd finds would drain the node), partition ``debug``;
  ``select/cons_tres`` with ``CR_CPU``: jobs share the node one CPU each, memory is not consumed;
- ``MaxArraySize`` small (16 by default), so a too-large array is cheap to submit;
- ``JobRequeue=1`` (Slurm's default: a batch job is requeueable unless it says ``--no-requeue``);
  ``job_requeue=False`` makes it 0, as many sites set it: only a job submitted with ``--requeue`` can
  be requeued (a test of a script's ``--requeue`` needs that cluster);
- ``AuthInfo=cred_expire=5`` (Slurm refuses 2): a requeued job waits ``cred_expire + 1`` s before it
  may start again (121 s with Slurm's default 120), and ``sched_interval=1,bf_interval=1`` so the
  scheduler looks at it within a second after that (60 s and 30 s by default): a requeued task
  restarts about 6 s after ``scontrol requeue``;
- fake GPUs: ``GresTypes=gpu`` and ``File=`` device nodes made with mknod (``c 1 3``, /dev/null's
  numbers). Slurm sets ``CUDA_VISIBLE_DEVICES``, ``GPU_DEVICE_ORDINAL`` and ``SLURM_STEP_GPUS``
  from them for ``--gpus-per-task`` / ``--gres=gpu:N``, as on a real node. Plain files would be
  counted too (slurmd logs "not a valid character or block device") but get no
  ``CUDA_VISIBLE_DEVICES``, so where mknod is refused the node has no GPUs and ``no_gpus`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
# Debian puts the daemons in /usr/sbin, which a non-login PATH may lack.
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
PR_SET_CHILD_SUBREAPER = 36


class SlurmUnavailable(RuntimeError):
    """The local cluster cannot start here; the message says what is missing, in one line."""


@dataclass
class LocalSlurm:
    """A one-node cluster in ``dir``; ``start()``/``stop()``, or use it as a context manager."""

    dir: Path
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    gpus: int = 2
    max_array_size: int = 16
    partition: str = "debug"
    cred_expire: int = 5
    job_requeue: bool = True
    start_timeout: float = 30.0
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    env: dict = field(init=False, default_factory=dict)
    started_in: float = field(init=False, default=0.0)
    no_gpus: str = field(init=False, default="")  # why gpus became 0, for a test to skip on
    _supervisor: subprocess.Popen | None = field(init=False, default=None, repr=False)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    # --- start and stop ---------------------------------------------------------------------

    def start(self) -> LocalSlurm:
        """Start munged, slurmctld and slurmd and wait until the node is idle; on any failure the
        cluster is torn down and SlurmUnavailable names the cause in one line."""
        path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
        missing = [p for p in DAEMONS + CLIENTS if not shutil.which(p, path=path)]
        if missing:
            raise SlurmUnavailable(f"{' '.join(missing)} not installed (apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("not root: slurmd runs as root here, to start jobs as any user")
        self.dir = Path(self.dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_files()
        # Whatever Slurm job this process may itself run in, the clients talk to this cluster only.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        self.env = {**env, "SLURM_CONF": str(self.conf), "PATH": path}
        t0 = time.monotonic()
        with open(self.dir / "log/supervisor.log", "ab") as log:
            self._supervisor = subprocess.Popen(
                [sys.executable, __file__, "supervise", str(self.dir), self.node],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # a Ctrl-C in the terminal reaches pytest, which then stops us
            )
        try:
            self._wait_idle(t0)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Kill every process of the cluster (daemons, job steps, their children) and wait for it."""
        sup, self._supervisor = self._supervisor, None
        if sup is not None:
            with contextlib.suppress(OSError):
                sup.stdin.close()
            try:
                sup.wait(timeout=20)
            except subprocess.TimeoutExpired:
                sup.kill()
                sup.wait()
        for pid in self.leftovers():  # only if the supervisor itself was killed: by pid, never by name
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def leftovers(self) -> list[int]:
        """Live processes (not this one) whose command line or environment names this cluster's directory."""
        token = str(self.dir).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if _state(int(entry.name)) in ("Z", None):
                    continue
                if token in (entry / "cmdline").read_bytes() or token in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    # --- using it ---------------------------------------------------------------------------

    def run(self, *cmd, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol, ...) against this cluster, its output as text; with
        check, a failure raises CalledProcessError whose message holds the command's stderr."""
        done = subprocess.run(
            [str(c) for c in cmd], env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and done.returncode:
            raise subprocess.CalledProcessError(done.returncode, f"{done.args}: {done.stderr.strip()}")
        return done

    def jobs(self, job_id: str | int) -> list[dict]:
        """``scontrol show job`` of a job (every task of an array), one dict of fields per job record."""
        out = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return [_fields(line) for line in out.splitlines() if line.strip()]

    def sbatch(self, *args, timeout: float = 120) -> list[dict]:
        """Submit, wait for the end of every task (polling: ``sbatch --wait`` sleeps in 2 s steps), and
        return the job's records."""
        return self.wait(self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0], timeout=timeout)

    def wait(self, job_id: str | int, timeout: float = 120) -> list[dict]:
        """Wait until no task of the job is pending, running or completing; return its records."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.run("squeue", "--noheader", "--array", "--jobs", str(job_id), check=False).stdout.strip()
            if not left:
                return self.jobs(job_id)
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still queued after {timeout} s:\n{left}\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of each daemon's log, for a failure message."""
        parts = []
        for name in ("supervisor", *DAEMONS):
            p = self.dir / "log" / f"{name}.log"
            if p.exists():
                tail = p.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {p}\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- internals --------------------------------------------------------------------------

    def _write_files(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log", "dev"):
            (d / sub).mkdir(exist_ok=True)
        (d / "munge").chmod(0o711)  # munged wants its key private and its socket reachable
        key = d / "munge/munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        for i in range(self.gpus):
            dev = d / f"dev/nvidia{i}"
            try:
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
            except OSError as e:
                # Plain files would still count as GPUs, but Slurm sets no CUDA_VISIBLE_DEVICES for them.
                self.gpus, self.no_gpus = 0, f"no fake GPUs: mknod {dev}: {e.strerror}"
                break
        (d / "plugstack.conf").write_text("")  # not the system's /etc/slurm/plugstack.conf
        ctld, slurmd = _free_ports(2)
        srun = _free_range(64)
        mem = _mem_total_mb() * 9 // 10
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        self.conf.write_text(
            f"""\
ClusterName=reelcache-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SrunPortRange={srun}-{srun + 63}
{conf_common(d, self.cred_expire)}MaxArraySize={self.max_array_size}
JobRequeue={int(self.job_requeue)}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem}{gres} State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )
        files = f"{d}/dev/nvidia[0-{self.gpus - 1}]" if self.gpus > 1 else f"{d}/dev/nvidia0"
        (d / "gres.conf").write_text(f"NodeName={self.node} Name=gpu File={files}\n" if self.gpus else "")

    def _wait_idle(self, t0: float) -> None:
        while True:
            state, err = self._node_state()
            if state == "idle":
                return
            if self._supervisor.poll() is not None:
                raise SlurmUnavailable(self._why_down())
            if time.monotonic() - t0 > self.start_timeout:
                seen = state or (err.splitlines() or ["nothing"])[-1]
                raise SlurmUnavailable(f"node {self.node} not idle after {self.start_timeout:.0f} s (sinfo: {seen})")
            time.sleep(0.1)

    def _node_state(self) -> tuple[str, str]:
        """sinfo's state of the node, given up as soon as the supervisor exits (sinfo would retry
        an absent controller for MessageTimeout, 10 s)."""
        cmd = ["sinfo", "--noheader", "--nodes", self.node, "--format", "%T"]
        with subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
            while p.poll() is None and self._supervisor.poll() is None:
                time.sleep(0.02)
            if p.poll() is None:
                p.kill()
            out, err = p.communicate()
        return out.strip(), err.strip()

    def _why_down(self) -> str:
        """One line: which daemon died and the last error it logged."""
        sup = (self.dir / "log/supervisor.log").read_text(errors="replace").strip().splitlines()
        line = sup[-1] if sup else "the supervisor exited"
        for name in DAEMONS:
            if line.startswith(f"{name} "):
                logs = [self.dir / "log" / f"{name}.{ext}" for ext in ("log", "out")]
                text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
                errors = [x.strip() for x in text.splitlines() if "fatal" in x.lower() or "error" in x.lower()]
                if errors:
                    return f"{line}: {errors[-1]}"
        return line


def _fields(line: str) -> dict:
    """``Key=value Key2=value 2 ...`` of scontrol's one-line output (a value may contain spaces)."""
    out, key = {}, None
    for tok in line.split(" "):
        if "=" in tok and tok.split("=", 1)[0].isidentifier():
            key, value = tok.split("=", 1)
            out[key] = value
        elif key is not None:
            out[key] += " " + tok
    return out


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_range(n: int) -> int:
    """The first port of n consecutive ports that are free now (srun listens on one of them)."""
    for _ in range(100):
        base = random.randrange(20000, 32000)
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise SlurmUnavailable(f"no {n} consecutive free ports for SrunPortRange")


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def conf_common(d: Path, cred_expire: int) -> str:
    """The slurm.conf lines both test clusters share (this one-node Slurm and tests/cluster_slurm.py's
    nodes): munge, state, spool, pids and logs in the test's folder (``%n``: per node), no accounting,
    cgroups or task plugins, a 1-second scheduler, a node that registers again back in service."""
    return f"""\
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire={cred_expire}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
ReturnToService=2
KillWait=2
MailProg=/bin/true
GresTypes=gpu
"""


def _state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0]


@contextlib.contextmanager
def local_slurm(directory, **kw) -> Iterator[LocalSlurm]:
    """A started cluster in `directory`, stopped on exit (also when the body raises)."""
    with LocalSlurm(Path(directory), **kw) as cluster:
        yield cluster


@contextlib.contextmanager
def local_slurm_or_skip(directory, **kw) -> Iterator[LocalSlurm]:
    """``local_slurm`` for a fixture: a cluster that cannot start skips the tests, saying why."""
    cluster = LocalSlurm(Path(directory), **kw)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


# --- the supervisor: this file run as `supervise DIR NODE` -------------------------------------


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap() -> list[tuple[int, int]]:
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def _kill_all() -> None:
    """SIGKILL every descendant, again until none is left (a process may fork while we look)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pids = _descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            if _state(pid) not in ("Z", None):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _reap()  # orphans of killed processes become ours and are reaped on the next rounds
        time.sleep(0.02)
    print(f"processes left after 15 s: {_descendants(os.getpid())}", flush=True)


def supervise(directory: str, node: str) -> None:
    d = Path(directory)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}", flush=True)
        sys.exit(1)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conf = str(d / "slurm.conf")
    cmds = {
        "munged": [
            "munged",
            "--foreground",
            "--force",  # as root, in a directory munged would not pick itself
            f"--key-file={d}/munge/munge.key",
            f"--socket={d}/munge/munge.socket",
            f"--pid-file={d}/munge/munged.pid",
            f"--seed-file={d}/munge/munged.seed",
            f"--log-file={d}/log/munged.log",
        ],
        "slurmctld": ["slurmctld", "-D", "-c", "-f", conf],  # -c: no state from an earlier start
        "slurmd": ["slurmd", "-D", "-f", conf, "-N", node],
    }
    pids: dict[int, str] = {}
    try:
        for name, cmd in cmds.items():
            with open(d / "log" / f"{name}.out", "ab") as out:
                pids[subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).pid] = name
            if name == "munged":
                deadline = time.monotonic() + 10
                while not (d / "munge/munge.socket").exists():
                    for pid, status in _reap():
                        if pid in pids:
                            print(f"munged exited with status {os.waitstatus_to_exitcode(status)}", flush=True)
                            return
                    if time.monotonic() > deadline:
                        print("munged made no socket in 10 s", flush=True)
                        return
                    time.sleep(0.01)
        print(f"started {', '.join(f'{n} ({p})' for p, n in pids.items())}", flush=True)
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], 0.2)
            if ready and not os.read(sys.stdin.fileno(), 4096):
                print("stdin closed: stopping", flush=True)
                return
            for pid, status in _reap():
                if pid in pids:
                    print(f"{pids[pid]} exited with status {os.waitstatus_to_exitcode(status)}", flush=True)
                    return
    finally:
        _kill_all()


def _up(directory: str | None) -> None:
    """By hand: a cluster until Ctrl-C."""
    import tempfile

    d = Path(directory or tempfile.mkdtemp(prefix="slurm-"))

    def stop(*_):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored)
        signal.signal(sig, stop)
    with local_slurm(d) as s:
        print(f"up in {s.started_in:.1f} s: {s.node}, partition {s.partition}, {s.cpus} CPUs, {s.gpus} fake GPUs")
        print(f"export SLURM_CONF={s.conf}")
        print("Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while s._supervisor.poll() is None:
                time.sleep(0.5)
            print(s.log_tail())


if __name__ == "__main__":
    if sys.argv[1:2] == ["supervise"]:
        supervise(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["up"]:
        _up(sys.argv[2] if len(sys.argv) > 2 else None)
    else:
        sys.exit("usage: slurm_local.py up [DIR]")
