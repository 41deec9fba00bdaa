"""What a rank imports before its first step, imported once for all the ranks of a ``reelcache train --nproc N``
on a CPU build of torch: train/launch.py names this module to the fork server its ranks are forked from.

A rank's interpreter spends most of a short run importing: torch, then ColossalAI, which brings peft,
transformers and bitsandbytes (about 14 CPU-s on a 2-core machine, against 1-2 s for the 15 steps of the
debug stage). Forked from one process that imported them, N ranks pay that once instead of N times. Importing
this module sets nothing up: no process group, no device, no thread of ours (torch and pyarrow start helper
threads of their own at import, as in every rank; what they hold is made safe across a fork by their at-fork
handlers, as for a DataLoader's forked workers).
"""

from reelcache.train import cli, trainer  # noqa: F401  (the rank's entry and everything a training imports)
from reelcache.train.parallel import colossalai_classes

colossalai_classes()  # ColossalAI and what it imports, quietly (its notices about optional CUDA kernels)
