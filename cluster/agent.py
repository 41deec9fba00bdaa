"""What ``reelcache cluster`` runs ON each node: standard library only, sent as source text.

The head never assumes reelcache is importable on a node, only that the same Python path exists
there (the usual shared install; ``--python`` overrides it). ``hosts.py`` sends this file's
source base64-encoded in one ``python -c`` argument, so no quoting layer (GNU parallel, ssh, the
remote shell) can touch it, followed by a call of :func:`main` with the request.

The agent reports raw tool outputs (nvidia-smi, chronyc, timedatectl, py-spy) as one JSON line
and leaves parsing to the head, where the parsers are tested on real sample texts. Processes are
only ever addressed as exactly the recorded (pid, kernel start time, boot id) of a rank record
(``ranks.py``, sent as its JSON object; this file cannot import it): a pidfd is opened
first and the record verified after, so a signal sent through the pidfd cannot reach a process
that took the pid over in between (Linux >= 5.3; older kernels verify-then-kill).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _run(argv, timeout=30.0) -> dict:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return {"rc": p.returncode, "out": p.stdout, "err": p.stderr}
    except subprocess.TimeoutExpired:
        return {"rc": None, "out": "", "err": f"timed out after {timeout:.0f} s"}
    except OSError as e:
        return {"rc": None, "out": "", "err": str(e)}


# ---------------------------------------------------------------- gpus

GPU_QUERY = "index,uuid,name,memory.used,memory.total,power.draw,utilization.gpu"
APP_QUERY = "gpu_uuid,pid,process_name,used_memory"


def gpus(req) -> dict:
    smi = shutil.which("nvidia-smi")
    res = {"host": socket.gethostname(), "nvidia_smi": smi}
    if not smi:
        return res
    res["gpu_reads"] = []
    for i in range(max(1, req.get("reads", 5))):
        # Power is a noisy instantaneous reading: a few reads apart give a mean worth comparing.
        res["gpu_reads"].append(_run([smi, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]))
        if i + 1 < req.get("reads", 5):
            time.sleep(req.get("interval", 0.2))
    res["apps"] = _run([smi, f"--query-compute-apps={APP_QUERY}", "--format=csv,noheader,nounits"])
    return res


# ---------------------------------------------------------------- clocks


def backwards(reads: int) -> dict:
    """Read the realtime clock in a tight loop; any read earlier than the one before is a step back."""
    now = time.time_ns
    prev = now()
    back, worst = 0, 0
    for _ in range(reads):
        t = now()
        if t < prev:
            back += 1
            worst = max(worst, prev - t)
        prev = t
    return {"reads": reads, "back": back, "worst_ns": worst}


def daemon_view() -> dict:
    if shutil.which("chronyc"):
        r = _run(["chronyc", "-n", "tracking"], timeout=5)
        if r["rc"] == 0:
            return {"tool": "chronyc", **r}
    if shutil.which("timedatectl"):
        r = _run(["timedatectl", "show"], timeout=5)
        if r["rc"] == 0:
            return {"tool": "timedatectl", **r}
        return {"tool": None, "err": f"timedatectl: {(r['err'] or r['out']).strip()[:200]}"}
    return {"tool": None, "err": "neither chronyc nor timedatectl found"}


def clocks(req) -> dict:
    """Ping-pong on stdin: each line 't' is answered with the clock at once (the head brackets it);
    'end' finishes with the backwards check and the sync daemon's view."""
    _emit({"ready": time.time_ns()})
    for line in sys.stdin:
        if line.strip() != "t":
            break
        sys.stdout.write(f"{time.time_ns()}\n")
        sys.stdout.flush()
    return {"host": socket.gethostname(), "backwards": backwards(req.get("reads", 200_000)), "daemon": daemon_view()}


# ---------------------------------------------------------------- processes of one run


def _stat(pid: int):
    """(state, start time in clock ticks after boot) from /proc/<pid>/stat, or None."""
    try:
        after = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return after[0], int(after[19])


def _boot_id():
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def verify(rec) -> str:
    """'' when rec's pid is still the recorded process and alive; else why not. ``rec`` is a rank
    record as the head sends it (``RankRecord.to_json()``, ranks.py): ``proc_start`` is the int the
    kernel shows as field 22 of /proc/<pid>/stat, which :func:`_stat` reads the same way."""
    if rec.get("boot_id") and rec["boot_id"] != _boot_id():
        return "pid gone or reused (the node rebooted since)"
    st = _stat(rec["pid"])
    if st is None:
        return "pid gone"
    if st[1] != rec.get("proc_start"):
        return "pid gone or reused (another process has it now)"
    if st[0] in ("Z", "X"):
        return "pid gone (exited, not yet reaped)"
    return ""


class Pinned:
    """One recorded process, held by a pidfd once verified."""

    def __init__(self, rec):
        self.rec, self.fd = rec, None
        try:
            self.fd = os.pidfd_open(rec["pid"])
        except ProcessLookupError:
            self.why = "pid gone"
            return
        except (AttributeError, OSError):
            self.fd = None  # no pidfd here: verify right before each signal instead
        self.why = verify(rec)
        if self.why:
            self.close()

    def alive(self) -> bool:
        if self.fd is not None and select.select([self.fd], [], [], 0)[0]:
            return False  # a pidfd turns readable when its process has exited
        return not verify(self.rec)

    def signal(self, sig) -> bool:
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            elif not verify(self.rec):
                os.kill(self.rec["pid"], sig)
            else:
                return False
            return True
        except ProcessLookupError:
            return False

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _py_spy():
    found = shutil.which("py-spy")
    beside = Path(sys.executable).parent / "py-spy"
    return found or (str(beside) if beside.exists() else None)


def _signal_dump(p: Pinned, timeout: float) -> dict:
    """faulthandler fallback: SIGUSR1 makes the rank append its stacks; return what was appended."""
    path = Path(p.rec.get("stacks") or "")
    if not p.rec.get("stacks"):
        return {"error": "the rank record names no stacks file"}
    before = path.stat().st_size if path.exists() else 0
    if not p.signal(signal.SIGUSR1):
        return {"error": "pid gone before SIGUSR1"}
    deadline, size, since = time.monotonic() + timeout, before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = path.stat().st_size if path.exists() else 0
        if now != size:
            size, since = now, time.monotonic()
        elif size > before and time.monotonic() - since > 0.3:
            break  # grew, then quiet: the handler has written all threads
    if size <= before:
        return {"error": f"no stacks appended to {path} within {timeout:.0f} s"}
    with open(path, "rb") as f:
        f.seek(before)
        return {"text": f.read(size - before).decode(errors="replace"), "method": "signal"}


def dump(req) -> dict:
    spy = None if req.get("method") == "signal" else _py_spy()
    if req.get("method") == "py-spy" and not spy:
        return {"host": socket.gethostname(), "error": "py-spy not found on this node"}
    out = []
    for rec in req["ranks"]:
        p = Pinned(rec)
        r = {"rank": rec["rank"]}
        if p.why:
            out.append({**r, "skipped": p.why})
            continue
        got = {}
        if spy:
            argv = [spy, "dump", "--pid", str(rec["pid"])] + (["--native"] if req.get("native") else [])
            res = _run(argv, timeout=req.get("timeout", 30))
            got = (
                {"text": res["out"], "method": "py-spy"}
                if res["rc"] == 0
                else {"error": f"py-spy: {(res['err'] or res['out']).strip()[-500:]}"}
            )
        if "text" not in got and req.get("method") != "py-spy":
            got = _signal_dump(p, req.get("timeout", 30)) | ({"py_spy_error": got["error"]} if got else {})
        why = verify(rec)  # the same process after the dump: else the text is another's
        if why and "text" in got:
            got = {"error": f"{why} during the dump; discarded"}
        p.close()
        out.append({**r, **got})
    return {"host": socket.gethostname(), "ranks": out}


def stop(req) -> dict:
    grace = req.get("grace", 30.0)
    ranks, pinned = [], []
    for rec in req["ranks"]:
        p = Pinned(rec)
        if p.why:
            ranks.append(
                {
                    "rank": rec["rank"],
                    "result": "already gone" if p.why == "pid gone" else p.why,
                    "stopped": False,
                    "survived": False,
                }
            )
        else:
            pinned.append(p)
    t0 = time.monotonic()
    for p in pinned:
        p.signal(signal.SIGTERM)
    state = {id(p): None for p in pinned}

    def wait(until, label):
        while time.monotonic() < until:
            for p in pinned:
                if state[id(p)] is None and not p.alive():
                    state[id(p)] = f"stopped by {label} after {time.monotonic() - t0:.1f} s"
            if all(state.values()):
                return
            time.sleep(0.05)

    wait(t0 + grace, "SIGTERM")
    for p in pinned:
        if state[id(p)] is None:
            p.signal(signal.SIGKILL)
    wait(time.monotonic() + 10, "SIGKILL")
    for p in pinned:
        res = state[id(p)] or "SURVIVED SIGKILL"
        ranks.append(
            {
                "rank": p.rec["rank"],
                "result": res,
                "stopped": state[id(p)] is not None,
                "survived": state[id(p)] is None,
            }
        )
        p.close()
    return {"host": socket.gethostname(), "ranks": sorted(ranks, key=lambda r: r["rank"])}


def main(req) -> None:
    ops = {"gpus": gpus, "clocks": clocks, "dump": dump, "stop": stop}
    _emit({"result": ops[req["op"]](req)})
