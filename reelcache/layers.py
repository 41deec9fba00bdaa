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
or under ``if TYPE_CHECKING:`` (a module that names another's types depends on it). ``reelcache/cli.py``
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
    "view": {"cache", "train", "eval", "cluster", "lineage"},  # shows every stage's outputs through its code
}
# What a stage offers the stages above it: the modules another stage may import (None: any of them).
PUBLIC = {
    "cache": {"encoders", "opensora_vae", "plan", "decode"},  # the encoders, a cache's config, a clip's window
    "cluster": {"ranks", "slurm.checks", "slurm.client", "slurm.jobs", "slurm.options"},
    "lineage": {"lineage"},
    "eval": {"video"},  # write_mp4, for the viewer's previews
    # Any train module, for now: issue 31's other half names the public ones eval and view may use.
    "train": None,
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


def imports_of(module: str, path: Path, known) -> set[str]:
    """The modules of ours `module` (in `path`) imports, anywhere in it."""
    out = set()
    here = module.split(".") if path.stem == "__init__" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def problems(g: dict[str, set[str]], known_cycles=()) -> list[str]:
    """What breaks the rules, one line each: an arrow to a package `src` may not import, an arrow into a
    module another stage does not offer, a cycle inside a package (but those in `known_cycles`)."""
    out = []
    for (src, dst), pairs in sorted(package_arrows(g).items()):
        for m, t in sorted(pairs):
            if not allowed(src, dst):
                out.append(f"{m} imports {t}: {src} may not import {dst}")
            elif dst in STAGES and PUBLIC.get(dst) is not None and t.split(".", 2)[-1] not in PUBLIC[dst]:
                out.append(f"{m} imports {t}: {dst} offers other stages {sorted(PUBLIC[dst])} only")
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
    """docs/imports.png: the packages on their floors, an arrow per imported package (its width: how many
    module arrows make it), an arrow the rules forbid in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arrows = package_arrows(g or graph())
    rows = defaultdict(list)
    for p in PACKAGES:
        rows[floor_of(p, arrows)].append(p)
    where = {p: (i - (len(ps) - 1) / 2, f) for f, ps in rows.items() for i, p in enumerate(ps)}
    fig, ax = plt.subplots(figsize=(9, 1.3 * len(rows) + 1))
    for (s, d), pairs in sorted(arrows.items()):
        (x0, y0), (x1, y1) = where[s], where[d]
        ax.annotate(
            "",
            (x1, y1 + 0.18),
            (x0, y0 - 0.18),
            arrowprops={
                "arrowstyle": "-|>",
                "lw": 0.6 + min(len(pairs), 20) / 8,
                "color": "#999" if allowed(s, d) else "red",
                "alpha": 0.8,
                "connectionstyle": "arc3,rad=0.12",
                "shrinkA": 6,
                "shrinkB": 6,
            },
        )
    for p, (x, y) in where.items():
        floor = p in FLOORS
        ax.text(
            x,
            y,
            p if p == GROUND else f"{p}/",
            ha="center",
            va="center",
            fontsize=11,
            bbox={"boxstyle": "round", "fc": "#dde8f5" if floor else "#f7f7f7", "ec": "#456" if floor else "#888"},
        )
    n = sum(len(v) for v in arrows.values())
    ax.set_title(f"reelcache: {len(arrows)} arrows between packages ({n} between their modules), drawn from the code")
    ax.set_xlim(min(x for x, _ in where.values()) - 0.8, max(x for x, _ in where.values()) + 0.8)
    ax.set_ylim(-0.6, max(rows) + 0.6)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m reelcache.layers OUT.png")
    draw(Path(sys.argv[1]))
