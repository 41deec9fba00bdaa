"""reelcache.train: the streaming loader over latent shards and the STDiT3 trainer on ColossalAI.

What other stages (eval, view, lineage) may use of train: the names in the ``__all__`` of the modules
in ``PUBLIC``, imported from the module that defines them; everything else is train's own and may change
with it. tests/core/test_package.py checks every import of train from another stage against this.
"""

PUBLIC = ("checkpoint", "config", "flow", "loader", "model", "runfiles", "runlog", "sections", "source", "weights")
