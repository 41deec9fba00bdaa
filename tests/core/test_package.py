"""The wheel installs only `reelcache.*`: bare base/train/cache/catalog/ingest/eval/cluster are not ours to take."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile

import pytest
from support import REPO


@pytest.mark.slow  # builds the wheel
def test_wheel_contains_only_the_reelcache_namespace(tmp_path):
    # Build from a copy of the tracked files: setuptools never prunes a stale build/ folder.
    files = subprocess.run(["git", "ls-files"], cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("reelcache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"reelcache", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for stage in ("base", "ingest", "catalog", "cache", "train", "eval", "cluster", "view", "lineage"):
        assert f"reelcache/{stage}/__init__.py" in names
    assert "reelcache/catalog/schema.sql" in names
    assert "reelcache/view/templates/base.html" in names  # the viewer's pages
    assert {"reelcache/view/static/view.js", "reelcache/view/static/view.css"} <= set(names)  # script, style
    assert "reelcache/cluster/agent.py" in names  # read as source text and sent to every node


def test_bare_stage_names_are_not_importable(tmp_path):
    names = ("base", "train", "cache", "catalog", "ingest", "eval", "cluster", "view", "lineage")
    code = (
        f"import importlib.util as u, {', '.join(f'reelcache.{n}' for n in names)};"
        f" print([n for n in {names!r} if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_cli_starts_without_heavy_imports(tmp_path):
    code = (
        "import sys; from reelcache.cli import build_parser; build_parser();"
        "print([m for m in ('torch','duckdb','av','pyarrow','matplotlib', 'tqdm', 'starlette', 'uvicorn', 'jinja2')"
        " if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_train_config_loads_no_torch(tmp_path):
    """train/config.py, with checkpoint, guard, runlog and watchdog, which it imports for their config
    sections, loads neither torch nor pyarrow nor wandb. Reading a stage file with ``load_config`` does
    import torch: ``validate`` builds the model's config (train/model.py) to check model.overrides."""
    code = (
        "import sys, reelcache.train.config;"
        "print([m for m in ('torch', 'pyarrow', 'wandb') if m in sys.modules],"
        " [m for m in ('checkpoint', 'guard', 'runlog', 'watchdog') if f'reelcache.train.{m}' not in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[] []"


def _names_all(path) -> set[str]:
    """The ``__all__`` a module declares (read from its source: importing train's modules loads torch)."""
    import ast

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_other_stages_use_only_trains_public_names():
    """train/__init__.py: another stage imports from train only the names in the ``__all__`` of the modules
    in PUBLIC, from the module that defines them (function-level imports included)."""
    import ast

    from reelcache.train import PUBLIC

    public = {m: _names_all(REPO / "train" / f"{m}.py") for m in PUBLIC}
    assert all(public.values()), [m for m, names in public.items() if not names]
    bad = []
    for stage in ("ingest", "catalog", "cache", "eval", "cluster", "lineage", "view"):
        for path in sorted((REPO / stage).rglob("*.py")):
            text = path.read_text()
            if "reelcache.train" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reelcache.train"):
                    module = node.module.removeprefix("reelcache.train").lstrip(".")
                    if not module:  # from reelcache.train import <module>
                        bad += [f"{where} {a.name}" for a in node.names if a.name not in PUBLIC]
                    elif module not in public:
                        bad.append(f"{where} reelcache.train.{module} (not a public module)")
                    else:
                        bad += [f"{where} {module}.{a.name}" for a in node.names if a.name not in public[module]]
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("reelcache.train."):
                            if a.name.split(".")[2] not in PUBLIC:
                                bad.append(f"{where} {a.name}")
    assert not bad, "imports of train's own names:\n" + "\n".join(bad)


def test_the_test_helper_modules_are_the_ones_style_md_names():
    """docs/STYLE.md: helpers live in tests/support.py, but for the modules it names (a data world, a
    cluster on one machine, a program run in other processes)."""
    import re

    style = (REPO / "docs/STYLE.md").read_text()
    rule = style[style.index("**Test helpers live in `tests/support.py`**") :].split("\n\n")[0]
    named = set(re.findall(r"`(\w+\.py)`", rule)) - {"support.py", "test_package.py"}
    present = {p.name for p in (REPO / "tests").glob("*.py")} - {"support.py", "conftest.py"}
    assert present == named, (
        f"in tests/ but not in STYLE.md: {sorted(present - named)}; gone: {sorted(named - present)}"
    )


def test_tests_import_no_private_name():
    """docs/STYLE.md: a test imports what a module offers, never a `_private` name of reelcache."""
    import re

    imports = re.compile(r"^\s*from (reelcache[\w.]*) import (\([^)]*\)|[^\n]*)", re.M)
    bad = [
        f"{path.relative_to(REPO)}: from {m.group(1)} import {name}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for m in imports.finditer(path.read_text())
        for name in re.findall(r"\b_\w+", re.sub(r"#[^\n]*", "", m.group(2)))
    ]
    assert not bad, bad


def test_root_cli_only_assembles_the_stages():
    """A stage owns its commands (<stage>/cli.py: add_commands, add_demo); reelcache/cli.py registers
    them in pipeline order and runs them, naming no stage module and declaring no stage argument."""
    import re

    from reelcache.cli import STAGES, build_parser

    src = (REPO / "reelcache/cli.py").read_text()
    assert not re.findall(r"reelcache\.(?:ingest|catalog|cache|train|eval|cluster|view|lineage)\b", src)
    assert src.count("add_argument(") == 1  # --version
    assert set(STAGES) == {p.name for p in REPO.iterdir() if (p / "cli.py").exists()} - {"reelcache"}
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {
        "ingest",
        "catalog",
        "cache",
        "train",
        "loader",
        "cluster",
        "eval",
        "view",
        "demo",
        "lineage",
        "takedown",
    } <= set(top.choices)


def test_cluster_never_imports_torch_or_another_stage(tmp_path):
    """`reelcache cluster` runs on a head node with no torch: importing every cluster module (and
    building its parser) loads neither torch nor the catalog nor another stage: it stands on base only."""
    code = (
        "import sys, argparse, pkgutil, importlib, reelcache.cluster as c\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module(f'reelcache.cluster.{m.name}')\n"
        "from reelcache.cluster.cli import add_commands\n"
        "add_commands(argparse.ArgumentParser().add_subparsers())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.split('.')[:2] in (['reelcache', s] for s in ('train', 'cache', 'ingest', 'eval', 'catalog'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_the_cluster_agent_needs_only_the_standard_library():
    """agent.py is sent as source to nodes where reelcache may not be importable: it imports the
    standard library only, and nothing of ours."""
    import ast

    tree = ast.parse((REPO / "cluster/agent.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
