"""Many nodes on one machine: N network + UTS + mount namespaces, each with its own hostname and a
real OpenSSH server, joined by a bridge. A test (or a person, as root) starts and stops it:

    cluster = LocalCluster(tmp_path / "cluster", nodes=3).up()   # ClusterUnavailable(reason) if it cannot
    cluster.run(1, "ssh", "node2", "hostname")                   # from the head node (node1): prints node2
    cluster.down()

    .venv/bin/python tests/cluster_local.py up [N] [DIR]   # by hand; prints how to enter node1
    .venv/bin/python tests/cluster_local.py down [DIR]

Network. Node i is the network namespace ``reelcache-<pid>-node<i>`` (pid: the process that made
it, so that two test runs at once each have their own) with one interface, ``eth0``, at
``<net>.<i>/24``; its other end is the port ``node<i>`` of the bridge ``br0``, which lives in a
namespace of its own (``reelcache-<pid>-bridge``). Nothing is added to the machine's own network namespace:
no interface, no address, no route. The /24 is a private one (``10.213.x.0/24`` by default) that no
interface of the machine uses, checked at ``up``; the nodes have no default route and no route out,
so test traffic reaches only the other nodes. ``cut(i)`` takes node i's bridge port down (its peers
then see silence, not a closed socket), ``join(i)`` brings it back.

Hostnames and names. Each node's first process is its sshd, started in a new UTS namespace (its
hostname is ``node<i>``) and a new mount namespace in which three files are bind-mounted, so that
the machine's own files stay as they are: ``/etc/hosts`` (the machine's, plus ``node1..N`` and their
addresses), ``/etc/ssh/ssh_config`` (the test's key, known-hosts file, ``BatchMode``: ``ssh node2 cmd``
works non-interactively and checks host keys; paramiko, under ``colossalai run``, reads it too) and
``/etc/hostname``. Every process of a node (ssh sessions, what ``run`` starts) is in these namespaces.
The file system is shared, as on a cluster with shared storage: the mounts are the machine's.

sshd. Debian's ``openssh-server`` (``make sysdeps`` installs it as root). Each node has a host key made
at ``up``, listens on its address, port 22, accepts the test's key for root only (``UsePAM no``, no
passwords), and sets ``PATH`` for sessions to ``<dir>/bin`` (for a fake ``nvidia-smi``, say) before the
usual one.

Teardown. Every process of a node is in its network namespace, however it was started or detached:
``down`` SIGKILLs ``ip netns pids`` of each until none is left, then deletes the namespaces. ``up``
(and ``cluster_local.py down``) first does the same for what a killed earlier run left: namespaces
named ``reelcache-<pid>-*`` whose pid is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PREFIX = "reelcache-"  # namespaces are reelcache-<pid of the process that made them>-node<i> / -bridge
SSHD = "/usr/sbin/sshd"
SESSION_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterUnavailable(RuntimeError):
    """The namespace cluster cannot start here; the message says what is missing, in one line."""


def _sh(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if check and done.returncode:
        raise ClusterUnavailable(f"{' '.join(map(str, cmd))}: {(done.stderr or done.stdout).strip()[-300:]}")
    return done


def _owner(ns: str) -> int | None:
    """The pid in a namespace name of ours, None for another name."""
    parts = ns.split("-")
    return int(parts[1]) if ns.startswith(PREFIX) and len(parts) == 3 and parts[1].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass
class LocalCluster:
    """N nodes in ``dir`` (keys, configs, logs); ``up()``/``down()``, or use it as a context manager."""

    dir: Path
    nodes: int = 3
    net: str = ""  # "10.213.7" (no last octet); empty: the first unused 10.213.x.0/24
    start_timeout: float = 20.0
    pids: dict = field(init=False, default_factory=dict)  # node -> its sshd's pid (the node's namespaces)
    tag: str = field(init=False, default_factory=lambda: f"{PREFIX}{os.getpid()}")
    _procs: dict = field(init=False, default_factory=dict, repr=False)

    @property
    def names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def node_ns(self, i: int) -> str:
        return f"{self.tag}-node{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-bridge"

    def addr(self, i: int) -> str:
        return f"{self.net}.{i}"

    # --- up and down ------------------------------------------------------------------------

    def up(self) -> LocalCluster:
        """Start the nodes and wait until ``ssh nodeJ true`` works from node1 for every J; on any failure
        everything is removed again and ClusterUnavailable names the cause in one line."""
        if os.geteuid() != 0:
            raise ClusterUnavailable("not root: network namespaces and sshd need root")
        missing = [p for p in ("ip", "nsenter", "unshare", "ssh", "ssh-keygen") if not shutil.which(p)]
        missing += [] if os.access(SSHD, os.X_OK) else ["sshd"]
        if missing:
            raise ClusterUnavailable(f"{' '.join(missing)} not installed (apt-get install iproute2 openssh-server)")
        remove_leftovers(self.tag)
        self.dir = Path(self.dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.net = self.net or _free_net()
            self._network()
            self._files()
            for i in range(1, self.nodes + 1):
                self._start_node(i)
            self._wait_ssh()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process of every node and delete the namespaces."""
        remove_leftovers(self.tag)
        for proc in self._procs.values():
            proc.wait()
        self.pids, self._procs = {}, {}

    def __enter__(self) -> LocalCluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # --- using it ---------------------------------------------------------------------------

    def prefix(self, i: int, cwd=None) -> list[str]:
        """The command prefix that runs something as node i (its network, hostname and mounts), in
        `cwd` (default: this process's; entering a mount namespace would otherwise go to /)."""
        return ["nsenter", "-t", str(self.pids[i]), "-n", "-u", "-m", f"--wd={cwd or os.getcwd()}", "--"]

    def env(self, **extra) -> dict:
        """The environment for a process on a node: this one's, with PATH led by ``<dir>/bin``."""
        return {**os.environ, "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', SESSION_PATH)}", **extra}

    def run(self, i: int, *cmd, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """A command on node i (default: the head, node1), its output as text."""
        kw.setdefault("env", self.env())
        done = subprocess.run(
            [*self.prefix(i, kw.pop("cwd", None)), *map(str, cmd)],
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )
        if check and done.returncode:
            raise AssertionError(f"node{i}: {' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stderr}")
        return done

    def popen(self, i: int, *cmd, **kw) -> subprocess.Popen:
        """A command started on node i in the background."""
        kw.setdefault("env", self.env())
        return subprocess.Popen([*self.prefix(i, kw.pop("cwd", None)), *map(str, cmd)], **kw)

    def node_pids(self, i: int) -> list[int]:
        """Every process of node i (``ip netns pids``)."""
        return [int(p) for p in _sh("ip", "netns", "pids", self.node_ns(i), check=False).stdout.split()]

    def kill_node(self, i: int, spare_sshd: bool = False) -> list[int]:
        """SIGKILL every process of node i (its sshd too, unless spared); returns the pids killed."""
        return self._signal_node(i, signal.SIGKILL, {self.pids[i]} if spare_sshd else set(), again=True)

    def freeze_node(self, i: int) -> list[int]:
        """SIGSTOP every process of node i but its sshd (as processes hang on storage mounted over a cut
        link); returns the pids stopped, for SIGCONT later."""
        return self._signal_node(i, signal.SIGSTOP, {self.pids[i]}, again=False)

    def _signal_node(self, i: int, sig: int, keep: set[int], again: bool) -> list[int]:
        """Send sig to node i's processes but ``keep`` until no process it should reach is listed: one
        not yet signalled may start another (listed on the next pass), and one may end before its signal
        (nothing to do). ``again``: a process still listed is signalled again (a killed one until it is
        gone); otherwise once (a stopped process stays listed)."""
        sent: list[int] = []
        for _ in range(50):
            pids = [p for p in self.node_pids(i) if p not in keep and (again or p not in sent)]
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
                sent.append(p)
            time.sleep(0.02)
        return sorted(set(sent))

    def restart(self, i: int) -> None:
        """Start node i's sshd again after ``kill_node`` (its namespaces went with its last process)."""
        self._start_node(i)
        self._wait_ssh([i])

    def cut(self, i: int) -> None:
        """Node i's link down: its packets go nowhere and nothing comes back (no reset, no close)."""
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"node{i}", "down")

    def join(self, i: int) -> None:
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"node{i}", "up")

    def hostfile(self, path: Path, slots: int | None = None, names: list[str] | None = None) -> Path:
        """A hostfile (GNU parallel's sshloginfile, colossalai's hostfile): one node name a line."""
        names = names or self.names
        path.write_text("".join(f"{slots}/{n}\n" if slots else f"{n}\n" for n in names))
        return path

    # --- internals --------------------------------------------------------------------------

    def _network(self) -> None:
        _sh("ip", "netns", "add", self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for i in range(1, self.nodes + 1):
            ns = self.node_ns(i)
            _sh("ip", "netns", "add", ns)
            _sh(
                "ip",
                "-n",
                self.bridge_ns,
                "link",
                "add",
                f"node{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _sh("ip", "-n", self.bridge_ns, "link", "set", f"node{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _files(self) -> None:
        d = self.dir
        (d / "bin").mkdir(exist_ok=True)
        (d / "log").mkdir(exist_ok=True)
        key = d / "id_ed25519"
        for p in (key, key.with_suffix(".pub")):
            p.unlink(missing_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "reelcache-cluster", "-f", key)
        (d / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        known = []
        for i, name in enumerate(self.names, 1):
            hk = d / f"host_{name}"
            for p in (hk, Path(f"{hk}.pub")):
                p.unlink(missing_ok=True)
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", hk)
            pub = " ".join(Path(f"{hk}.pub").read_text().split()[:2])
            known.append(f"{name},{self.addr(i)} {pub}\n")
            (d / f"sshd_{name}.conf").write_text(
                f"ListenAddress {self.addr(i)}:22\nHostKey {hk}\nPidFile {d}/sshd_{name}.pid\n"
                f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                f"MaxStartups 100:30:200\nMaxSessions 100\nSetEnv PATH={d / 'bin'}:{SESSION_PATH}\n"
                "Subsystem sftp internal-sftp\nLogLevel ERROR\n"
            )
        (d / "known_hosts").write_text("".join(known))
        (d / "ssh_config").write_text(
            f"Host *\n  IdentityFile {key}\n  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n  ConnectTimeout 5\n  ServerAliveInterval 2\n  ServerAliveCountMax 3\n"
            "  LogLevel ERROR\n"
        )
        hosts = Path("/etc/hosts").read_text()
        extra = "".join(f"{self.addr(i)}\t{n}\n" for i, n in enumerate(self.names, 1))
        (d / "hosts").write_text(f"{hosts.rstrip()}\n# reelcache test cluster\n{extra}")
        for name in self.names:
            (d / f"hostname_{name}").write_text(f"{name}\n")

    def _start_node(self, i: int) -> None:
        d, name = self.dir, f"node{i}"
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        script = (
            f"set -e; mount --make-rprivate /; hostname {name}; "
            f"mount --bind {d}/hosts /etc/hosts; mount --bind {d}/hostname_{name} /etc/hostname; "
            f"mount --bind {d}/ssh_config /etc/ssh/ssh_config; "
            f"exec {SSHD} -D -e -f {d}/sshd_{name}.conf"
        )
        with open(d / "log" / f"sshd_{name}.log", "ab") as log:
            proc = subprocess.Popen(
                # nsenter, not `ip netns exec`: that remounts /sys for the namespace, without the
                # cgroup file system slurmd needs
                [
                    "nsenter",
                    f"--net=/run/netns/{self.node_ns(i)}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--",
                    "sh",
                    "-c",
                    script,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids[i] = proc.pid  # nsenter and unshare exec; sh execs sshd: one pid throughout
        self._procs[i] = proc

    def _wait_ssh(self, which: list[int] | None = None) -> None:
        t0 = time.monotonic()
        for i in which or range(1, self.nodes + 1):
            name = f"node{i}"
            while True:
                if self._procs[i].poll() is not None:
                    log = (self.dir / "log" / f"sshd_{name}.log").read_text(errors="replace").strip()
                    raise ClusterUnavailable(f"sshd on {name} exited: {(log.splitlines() or ['no output'])[-1]}")
                done = subprocess.run(
                    [*self.prefix(1), "ssh", name, "hostname"], capture_output=True, text=True, timeout=30
                )
                if done.returncode == 0 and done.stdout.strip() == name:
                    break
                if time.monotonic() - t0 > self.start_timeout:
                    raise ClusterUnavailable(f"ssh {name} from node1 failed: {done.stderr.strip()[-200:]}")
                time.sleep(0.1)


def _free_net() -> str:
    """The first 10.213.x.0/24 that no interface of this machine has an address in."""
    used = []
    for line in _sh("ip", "-o", "-4", "addr", "show").stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    for x in range(7, 250):
        net = ipaddress.ip_network(f"10.213.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return f"10.213.{x}"
    raise ClusterUnavailable("no free 10.213.x.0/24 on this machine")


def remove_leftovers(tag: str | None = None) -> None:
    """SIGKILL every process of the namespaces ``tag`` names, and of those whose maker is gone (a killed
    earlier run, or ``up`` by hand), then delete them. A live cluster of another process stays."""
    names = [line.split()[0] for line in _sh("ip", "netns", "list", check=False).stdout.splitlines() if line]
    for ns in names:
        owner = _owner(ns)
        if owner is None or not ((tag and ns.startswith(f"{tag}-")) or not _alive(owner)):
            continue
        for _ in range(100):
            pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.05)
        _sh("ip", "netns", "delete", ns, check=False)


@contextlib.contextmanager
def local_cluster_or_skip(directory, **kw):
    """A started cluster for a fixture: one that cannot start skips the tests, saying why."""
    cluster = LocalCluster(Path(directory), **kw)
    try:
        cluster.up()
    except ClusterUnavailable as e:
        pytest.skip(f"no namespace cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.down()


def _main(argv: list[str]) -> int:
    if argv[:1] == ["up"]:
        n = int(argv[1]) if len(argv) > 1 else 3
        d = Path(argv[2] if len(argv) > 2 else "/tmp/reelcache-cluster")
        c = LocalCluster(d, nodes=n).up()
        print(f"up: {n} nodes on {c.net}.0/24, files in {c.dir}")
        print(f"enter the head node: nsenter -t {c.pids[1]} -n -u -m bash   (then: ssh node2 hostname)")
        return 0
    if argv[:1] == ["down"]:
        remove_leftovers()
        print("down")
        return 0
    print("usage: cluster_local.py up [N] [DIR] | down", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
