"""The floors and who may import whom (reelcache/layers.py; docs/DESIGN.md, "Floors"), read from the code with
``ast``: a floor imports only the floors beneath it, a stage the floors and the modules the stages it may
import offer, and no package holds an import cycle, lazy imports included."""

from __future__ import annotations

from reelcache import layers


def test_every_import_keeps_to_the_floors():
    g = layers.graph()
    assert len(g) > 100 and all(layers.package_of(m) in layers.PACKAGES for m in g)
    assert layers.problems(g) == []


def test_a_forbidden_arrow_and_a_cycle_are_found_wherever_the_import_stands(tmp_path):
    """A tree of small modules, each breaking one rule, in the places an import hides: inside a function,
    relative, `import a.b`, `from package import module`; an import under TYPE_CHECKING (annotations only)
    makes no cycle."""
    files = {
        "reelcache/__init__.py": "",
        "base/shards.py": "def f():\n    from reelcache.cache.run import x\n",  # a floor importing a stage
        "catalog/db.py": "from reelcache.base import shards\n",  # allowed: a floor beneath
        "cluster/ranks.py": "from reelcache.catalog import db\n",  # cluster stands on base only
        "ingest/run.py": "import reelcache.cache.run\n",  # a stage ACROSS does not name
        "eval/once.py": "from reelcache.cache import store, encoders\n",  # store is not one cache offers
        "cache/run.py": "def f():\n    from reelcache.cache import plan, store\n",
        "cache/plan.py": "def g():\n    import reelcache.cache.run\n",
        "cache/store.py": "import typing\nif typing.TYPE_CHECKING:\n    from reelcache.cache.run import x\n",
        "cache/encoders.py": "",
        "view/pages.py": "from . import server\n",
        "view/server.py": "from .pages import page\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    dirs = {p: tmp_path / p for p in {f.split("/")[0] for f in files}}
    assert layers.problems(layers.graph(dirs)) == [
        "reelcache.base.shards imports reelcache.cache.run: base may not import cache",
        "reelcache.cluster.ranks imports reelcache.catalog.db: cluster may not import catalog",
        "reelcache.eval.once imports reelcache.cache.store: cache offers other stages "
        "['decode', 'encoders', 'opensora_vae', 'plan', 'spec'] only",
        "reelcache.ingest.run imports reelcache.cache.run: ingest may not import cache",
        "an import cycle inside cache: reelcache.cache.plan <-> reelcache.cache.run",
        "an import cycle inside view: reelcache.view.pages <-> reelcache.view.server",
    ]
