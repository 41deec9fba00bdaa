"""The floors of the package and who may import whom, read from the code (``python -m reelcache.layers PNG``).

Three floors hold up the stages: ``reelcache/`` (the ground floor: the CLI, settings, logging, isolation,
media helpers), ``base/`` (what every stage shares and that touches no database: units and their claim,
leases, shards and atomic publishing, the latent sample format, buckets) and ``catalog/`` (DuckDB: schema,
merge, manifests, queries). A floor imports only the floors beneath it; a stage imports the floors
(cluster: not the catalog) and, of the other stages, only those ``ACROSS`` names and only the modules they
offer (``PUBLIC``). Inside a package no two modules import each other, directly or round a loop, lazily
inside a function or not (a cycle held together by a lazy import is a cycle). This module is the one
statement of those rules: ``tests/core/test_layers.py`` checks them, ``make imports`` draws the graph
(docs/imports.png), docs/DESIGN.md ("Floors") explains them.

The graph is read with ``ast``, nothing is imported, so the check is fast and sees imports deferred into
functions. An import is an arrow from the importing module to the module it names (``from reelcache.x import
y`` names ``reelcache.x.y`` when that is a module, else ``reelcache.x``), wherever it stands: in a function,
but not under ``if TYPE_CHECKING:`` (annotations only, never run: a config section builds its component
lazily, and the component names its section's type back). ``reelcache/cli.py``
imports each stage's ``cli`` by name at run time (``importlib``): the assembler above the floors, not an
arrow the graph shows.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

# matplotlib is imported by `draw` only: the suite's check reads the graph without it.

GROUND = "reelcache"
FLOORS = (GROUND, "base", "catalog")  # bottom up: each imports only those beneath it
STAGES = ("ingest", "cache", "train", "cluster", "lineage", "eval", "view")  # each imports the floors
PACKAGES = FLOORS + STAGES
# cluster (operations over the nodes of every stage) runs on head nodes without the DuckDB catalog.
FLOORS_OF = {"cluster": (GROUND, "base")}
# The arrows between stages the design has (docs/DESIGN.md, "Floors"): stage -> the stages it may import.
ACROSS = {
    "train": {"cluster"},  # the rank records the cluster checks read, and the Slurm jobs train submits
    "lineage": {"train"},  # from a clip to the runs and checkpoints that saw it
    "eval": {"cache", "train", "cluster"},  # composes cache's encoders with train's model, loader and sampler
    "view": {"cache", "train", "cluster", "lineage"},  # shows every stage's outputs through its code
}
# What a stage offers the stages above it: the modules another stage may import (None: any of them).
PUBLIC = {
    "cache": {"encoders", "opensora_vae", "plan", "decode", "spec"},  # the encoders, a cache's config, a clip's window
    "cluster": {"ranks", "slurm.checks", "slurm.client", "slurm.jobs", "slurm.options"},
    "lineage": {"lineage"},
    "train": None,  # what train/__init__.py declares public (its PUBLIC), read by public_of
}


def package_dirs() -> dict[str, Path]:
    """Each package's source folder, found as Python finds it (the repository's folders under an editable
    install, site-packages under a wheel), without importing any of them."""
    out = {GROUND: Path(importlib.util.find_spec(GROUND).origin).parent}
    for name in PACKAGES[1:]:
        spec = importlib.util.find_spec(f"{GROUND}.{name}")
        out[name] = Path(next(iter(spec.submodule_search_locations)))
    return out


def modules(dirs: dict[str, Path] | None = None) -> dict[str, Path]:
    """Every module of the package, dotted name -> file."""
    dirs = dirs or package_dirs()
    out = {}
    for name, d in dirs.items():
        files = sorted(d.glob("*.py")) if name == GROUND else sorted(d.rglob("*.py"))
        for f in files:
            parts = [GROUND] + ([] if name == GROUND else [name, *f.relative_to(d).parent.parts])
            out[".".join(parts + ([] if f.stem == "__init__" else [f.stem]))] = f
    return out


def package_of(module: str) -> str:
    """The package (a floor or a stage) a module of ours belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else GROUND


def public_of(stage: str, dirs: dict[str, Path] | None = None) -> set[str] | None:
    """The modules `stage` offers the others: PUBLIC's entry, or where that is None the ``PUBLIC`` tuple its
    ``__init__.py`` declares (read, not imported: train's loads torch), or None (any module)."""
    if PUBLIC.get(stage) is not None:
        return PUBLIC[stage]
    init = (dirs or package_dirs())[stage] / "__init__.py"
    for node in ast.parse(init.read_text()).body if init.exists() else ():
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PUBLIC" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _type_only(tree) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }


def imports_of(module: str, path: Path, known) -> set[str]:
    """The modules of ours `module` (in `path`) imports, anywhere in it but under ``if TYPE_CHECKING:``."""
    out = set()
    here = module.split(".") if path.stem == "__init__" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level` folders up
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n == GROUND or n.startswith(GROUND + ".")}
    return out - {module}


def graph(dirs: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the modules of ours it imports."""
    mods = modules(dirs)
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def package_arrows(g: dict[str, set[str]]) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(package, package it imports) -> the (module, module) arrows that make it."""
    out = defaultdict(set)
    for m, targets in g.items():
        for t in targets:
            if package_of(m) != package_of(t):
                out[package_of(m), package_of(t)].add((m, t))
    return dict(out)


def allowed(src: str, dst: str) -> bool:
    """Whether package `src` may import package `dst`."""
    if src in FLOORS:
        return dst in FLOORS[: FLOORS.index(src)]
    return dst in FLOORS_OF.get(src, FLOORS) or dst in ACROSS.get(src, ())


def problems(g: dict[str, set[str]], known_cycles=(), dirs: dict[str, Path] | None = None) -> list[str]:
    """What breaks the rules, one line each: an arrow to a package `src` may not import, an arrow into a
    module another stage does not offer, a cycle inside a package (but those in `known_cycles`)."""
    out = []
    for (src, dst), pairs in sorted(package_arrows(g).items()):
        offered = public_of(dst, dirs) if dst in STAGES else None
        for m, t in sorted(pairs):
            if not allowed(src, dst):
                out.append(f"{m} imports {t}: {src} may not import {dst}")
            elif offered is not None and t.split(".", 2)[-1] not in offered:
                out.append(f"{m} imports {t}: {dst} offers other stages {sorted(offered)} only")
    known = [sorted(c) for c in known_cycles]
    out += [f"an import cycle inside {package_of(c[0])}: {' <-> '.join(c)}" for c in cycles(g) if c not in known]
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles inside each package: strongly connected sets of >1 module (Tarjan's), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in (w for w in g.get(v, ()) if w in g and package_of(w) == package_of(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while not scc or scc[-1] != v:
                scc.append(stack.pop())
                on.discard(scc[-1])
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def floor_of(package: str, arrows, seen: tuple = ()) -> int:
    """How high a package stands: 0 for one that imports no other, else one above the highest it imports
    (an arrow back into a package on the way, which the rules forbid, is not followed)."""
    below = {d for s, d in arrows if s == package and d != package and d not in seen}
    return 1 + max((floor_of(d, arrows, (*seen, package)) for d in below), default=-1)


def draw(path: Path, g: dict[str, set[str]] | None = None) -> None:
    """docs/imports.png: the floors as bands, each listing its modules, and the stages above them, each as high
    as the stages it imports. An arrow down from a stage: the floors it imports (named when not all); an arrow
    between stages: how many module imports make it; an arrow the rules forbid is red."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    g = g or graph()
    arrows = package_arrows(g)
    stage_arrows = {(s, d) for s, d in arrows if s in STAGES and d in STAGES}
    order = ("ingest", "cache", "eval", "view", "lineage", "train", "cluster")  # few crossings
    order += tuple(p for p in STAGES if p not in order)
    where = {p: (1.6 * i, len(FLOORS) + floor_of(p, stage_arrows)) for i, p in enumerate(order)}
    right, top = 1.6 * len(order), max(y for _, y in where.values())
    fig = Figure(figsize=(11, 0.95 * (top + 1) + 0.5))
    ax = fig.add_subplot()
    ax.set_xlim(-0.9, right + 0.2)
    ax.set_ylim(-0.45, top + 0.45)
    ax.axis("off")
    arrow = {"arrowstyle": "-|>", "shrinkA": 0, "shrinkB": 0, "mutation_scale": 12}
    for y, floor in enumerate(FLOORS):
        names = sorted({m.rsplit(".", 1)[-1] for m in g if package_of(m) == floor and m.count(".") == 1 + (y > 0)})
        box = FancyBboxPatch((-0.8, y - 0.3), right + 0.2, 0.6, boxstyle="round,pad=0.02", fc="#dde8f5", ec="#456")
        ax.add_patch(box)
        ax.text(-0.7, y + 0.06, floor if floor == GROUND else f"{floor}/", fontsize=12, weight="bold")
        ax.text(-0.7, y - 0.2, ", ".join(names), fontsize=7.5, color="#345")
        for d in FLOORS[:y]:  # a floor -> the floors beneath it that it imports, at the right end
            x = right - 1.25 + 0.15 * (y + FLOORS.index(d))
            color = "#567" if (floor, d) in arrows else "none"
            ax.annotate("", (x, FLOORS.index(d) + 0.3), (x, y - 0.3), arrowprops=arrow | {"color": color})
    for p, (x, y) in where.items():
        floors = [d for d in FLOORS if (p, d) in arrows]
        high = max((FLOORS.index(d) for d in floors), default=0)
        bad = [d for d in floors if not allowed(p, d)]
        ax.annotate("", (x, high + 0.3), (x, y - 0.22), arrowprops=arrow | {"color": "red" if bad else "#9ab"})
        if floors != list(FLOORS):
            ax.text(x - 0.06, high + 0.4, " + ".join(floors), fontsize=7.5, color="#567", ha="right")
        ax.text(
            x, y, f"{p}/", ha="center", va="center", fontsize=11, bbox={"boxstyle": "round", "fc": "white"}, zorder=5
        )
    for s, d in sorted(stage_arrows):
        (x0, y0), (x1, y1) = where[s], where[d]
        color, n = ("#333" if allowed(s, d) else "red"), len(arrows[s, d])
        style = {"color": color, "connectionstyle": "arc3,rad=-0.12", "lw": 0.8 + min(n, 15) / 10}
        ax.annotate("", (x1, y1 + 0.2), (x0, y0 - 0.2), arrowprops=arrow | style)
        ax.text(x0 + 0.7 * (x1 - x0), y0 + 0.7 * (y1 - y0), str(n), fontsize=7.5, color=color, ha="center", va="center",
                bbox={"boxstyle": "circle,pad=0.15", "fc": "white", "ec": "none"})  # fmt: skip
    n = sum(len(v) for v in arrows.values())
    fig.suptitle(
        f"reelcache's floors and stages, drawn from the code (reelcache/layers.py, make imports)\n{len(arrows)} "
        f"arrows between packages, {n} imports between their modules; a number: the imports between two stages",
        fontsize=9.5,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m reelcache.layers OUT.png")
    draw(Path(sys.argv[1]))
