"""A multi-node Slurm on the namespace cluster (tests/cluster_local.py): munged and slurmctld on node1,
one slurmd on every node (``NodeName=node<i> NodeAddr=<its address>``), all of them processes of the
nodes' namespaces, so the cluster's ``down`` (or ``stop`` here) removes them with everything they started.

    slurm = NodeSlurm(cluster, tmp_path / "slurm").start()   # SlurmUnavailable(reason) if it cannot
    cluster.run(1, "sbatch", "--wait", "-N", "3", "--wrap", "srun hostname", env=slurm.env)
    slurm.stop()

Settings as tests/slurm_local.py's (no accounting, no cgroups, JobRequeue=1, a requeued job may
restart ``cred_expire + 1`` s later), and the fixed ports 6817/6818: each node has its own network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_local import CLIENTS, DAEMONS, SBIN, SlurmUnavailable, _fields, _mem_total_mb, conf_common


@dataclass
class NodeSlurm:
    cluster: object
    dir: Path
    partition: str = "debug"
    cred_expire: int = 5
    start_timeout: float = 40.0
    env: dict = field(init=False, default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def start(self) -> NodeSlurm:
        path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
        missing = [p for p in DAEMONS + CLIENTS if not shutil.which(p, path=path)]
        if missing:
            raise SlurmUnavailable(f"{' '.join(missing)} not installed (apt-get install slurm-wlm munge)")
        self.dir = Path(self.dir).resolve()
        self._write_files()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        self.env = self.cluster.env(**{**env, "SLURM_CONF": str(self.conf)})
        self.env["PATH"] = f"{self.env['PATH']}:{':'.join(SBIN)}"
        d, c = self.dir, self.cluster
        self._spawn(1, "munged", "munged", "--foreground", "--force", f"--key-file={d}/munge/munge.key",
                    f"--socket={d}/munge/munge.socket", f"--pid-file={d}/munge/munged.pid",
                    f"--seed-file={d}/munge/munged.seed", f"--log-file={d}/log/munged.log")  # fmt: skip
        deadline = time.monotonic() + 10
        while not (d / "munge/munge.socket").exists():
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged made no socket in 10 s")
            time.sleep(0.02)
        self._spawn(1, "slurmctld", "slurmctld", "-D", "-c", "-f", self.conf)
        for i in range(1, c.nodes + 1):
            self._spawn(i, f"slurmd-node{i}", "slurmd", "-D", "-f", self.conf, "-N", f"node{i}")
        self._wait_idle()
        return self

    def stop(self) -> None:
        """Every process of the nodes but their sshd: daemons, job steps and their children."""
        for i in range(1, self.cluster.nodes + 1):
            self.cluster.kill_node(i, spare_sshd=True)

    def restart_slurmd(self, i: int) -> None:
        """Node i's slurmd again after ``kill_node`` (ReturnToService=2: it comes back idle)."""
        self._spawn(i, f"slurmd-node{i}", "slurmd", "-D", "-f", self.conf, "-N", f"node{i}")
        self._wait_idle()

    def run(self, *cmd, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A client command on the head node (node1)."""
        return self.cluster.run(1, *cmd, check=check, timeout=timeout, env=self.env, **kw)

    def wait(self, job: str, timeout: float = 300) -> list[dict]:
        """Wait until the job (every task of an array) left the queue; ``scontrol show job``'s records."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "--noheader", "--array", "--jobs", job, check=False).stdout.strip():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still queued after {timeout} s")
            time.sleep(0.3)
        out = self.run("scontrol", "show", "job", "--oneliner", job).stdout
        return [_fields(line) for line in out.splitlines() if line.strip()]

    def _spawn(self, i: int, name: str, *cmd) -> None:
        with open(self.dir / "log" / f"{name}.out", "ab") as out:
            self.cluster.popen(i, *cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_idle(self) -> None:
        t0 = time.monotonic()
        while True:
            out = self.run("sinfo", "--noheader", "--format", "%n %T", check=False, timeout=20).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == self.cluster.nodes and set(states.values()) == {"idle"}:
                return
            if time.monotonic() - t0 > self.start_timeout:
                raise SlurmUnavailable(f"nodes not idle after {self.start_timeout:.0f} s: {states or out}")
            time.sleep(0.3)

    def _write_files(self) -> None:
        d, c = self.dir, self.cluster
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "munge").chmod(0o711)
        key = d / "munge/munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        (d / "plugstack.conf").write_text("")
        (d / "gres.conf").write_text("")
        cpus, mem = os.cpu_count() or 1, _mem_total_mb() * 9 // 10
        nodes = "".join(
            f"NodeName=node{i} NodeAddr={c.addr(i)} CPUs={cpus} RealMemory={mem} State=UNKNOWN\n"
            for i in range(1, c.nodes + 1)
        )
        self.conf.write_text(
            f"""\
ClusterName=reelcache-nodes
SlurmctldHost=node1({c.addr(1)})
SlurmctldPort=6817
SlurmdPort=6818
SrunPortRange=60001-60063
{conf_common(d, self.cred_expire)}SlurmdTimeout=10
JobRequeue=1
{nodes}PartitionName={self.partition} Nodes=node[1-{c.nodes}] Default=YES MaxTime=INFINITE State=UP
"""
        )
