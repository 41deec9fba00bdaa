"""``reelcache cluster gpus``: every node's GPUs, their memory, mean power and the processes on them.

Run before a launch with ``--expect-idle``: a process from an earlier job still holding a GPU (the
replication's most common lost hour) fails the check. The agent on each node runs nvidia-smi a
few times (power is a noisy instantaneous reading; the table shows the mean) and returns its raw
CSV; the parsing is here, tested on nvidia-smi's documented output, "[N/A]" values included.
"""

from __future__ import annotations

from reelcache.cluster.hosts import node_logins, node_name, run_agents


def _num(v: str):
    v = v.strip()
    try:
        return float(v)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]": nvidia-smi's words for no value


def parse_gpu_csv(text: str) -> list[dict]:
    """``--query-gpu=index,uuid,name,memory.used,memory.total,power.draw,utilization.gpu
    --format=csv,noheader,nounits``: one line a GPU."""
    gpus = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) != 7 or not f[0].isdigit():
            continue
        gpus.append(
            {
                "index": int(f[0]),
                "uuid": f[1],
                "name": f[2],
                "mem_used": _num(f[3]),
                "mem_total": _num(f[4]),
                "power": _num(f[5]),
                "util": _num(f[6]),
            }
        )
    return gpus


def parse_apps_csv(text: str) -> list[dict]:
    """``--query-compute-apps=gpu_uuid,pid,process_name,used_memory``: a process name may hold commas."""
    apps = []
    for line in text.splitlines():
        parts = line.split(",", 2)
        if len(parts) < 3 or not parts[1].strip().isdigit():
            continue
        name, mem = parts[2].rsplit(",", 1) if "," in parts[2] else (parts[2], "")
        apps.append({"gpu_uuid": parts[0].strip(), "pid": int(parts[1]), "name": name.strip(), "mem": _num(mem)})
    return apps


def gpu_report(res: dict) -> tuple[list[str], list[str], int]:
    """Lines for one node's answer, its problems, and its GPU process count."""
    if not res.get("nvidia_smi"):
        return ["  no GPU (no nvidia-smi on this node)"], [], 0
    reads = res["gpu_reads"]
    failed = [r for r in reads if r["rc"] != 0]
    if failed:
        msg = (failed[0]["err"] or failed[0]["out"]).strip()
        if "No devices were found" in msg:
            return [f"  no GPU (nvidia-smi: {msg})"], [], 0
        return [f"  nvidia-smi failed: {msg}"], [f"nvidia-smi failed: {msg[:120]}"], 0
    samples = [parse_gpu_csv(r["out"]) for r in reads]
    gpus = samples[-1]
    if not gpus:
        return ["  no GPU (nvidia-smi lists none)"], [], 0
    apps = parse_apps_csv(res["apps"]["out"]) if res["apps"]["rc"] == 0 else []
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    names = sorted({g["name"] for g in gpus})
    lines = [
        f"  {len(gpus)} x {', '.join(names)}",
        f"  {'gpu':>3}  {'memory used / total MiB':>24}  {f'power W (mean of {len(samples)})':>20}  "
        f"{'util %':>6}  procs",
    ]
    for g in gpus:
        power = [s["power"] for read in samples for s in read if s["index"] == g["index"] and s["power"] is not None]
        mean = f"{sum(power) / len(power):.1f}" if power else "n/a"
        n = sum(1 for a in apps if a["gpu_uuid"] == g["uuid"])
        mem = f"{g['mem_used'] or 0:.0f} / {g['mem_total'] or 0:.0f}"
        util = "n/a" if g["util"] is None else f"{g['util']:.0f}"
        lines.append(f"  {g['index']:>3}  {mem:>24}  {mean:>20}  {util:>6}  {n}")
    if apps:
        lines.append(f"  {'gpu':>3}  {'pid':>8}  {'MiB':>8}  process")
        for a in apps:
            mem = "n/a" if a["mem"] is None else f"{a['mem']:.0f}"
            lines.append(f"  {by_uuid.get(a['gpu_uuid'], '?'):>3}  {a['pid']:>8}  {mem:>8}  {a['name']}")
    return lines, [], len(apps)


def cmd_gpus(a) -> int:
    logins = node_logins(a.hostfile, a.nodelist)
    answers = run_agents({lg: {"op": "gpus", "reads": a.reads} for lg in logins}, a.python, a.timeout)
    bad = 0
    for login in logins:
        res, err = answers[login]
        print(f"node {node_name(login, res)}")
        if res is None:
            print(f"  UNREACHABLE: {err}")
            bad += 1
            continue
        lines, problems, nproc = gpu_report(res)
        print("\n".join(lines))
        if a.expect_idle and nproc:
            problems.append(f"{nproc} GPU process(es) running (--expect-idle)")
        for p in problems:
            print(f"  ERROR: {p}")
        bad += bool(problems)
    return 1 if bad else 0
