"""``python -m reelcache.train`` with rank 0's checkpoint writer slowed down or failing (tests only).

REELCACHE_TEST_SLOW_WRITE_S=2     each weights folder is written 2 s late (training goes on meanwhile)
REELCACHE_TEST_FAIL_WRITE_AT=4    the checkpoint of step 4 fails with ENOSPC after its model/ is written
"""

import errno
import os
import sys
import time
from pathlib import Path

from reelcache.train import checkpoint, weights

_save_sharded = weights.save_sharded


def save_sharded(state, folder, *args, **kwargs):
    folder = Path(folder)
    step = checkpoint.ckpt_step(folder.parent.name.removeprefix(".tmp-"))
    time.sleep(float(os.environ.get("REELCACHE_TEST_SLOW_WRITE_S", "0")))
    if folder.name == "ema" and os.environ.get("REELCACHE_TEST_FAIL_WRITE_AT") == str(step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    return _save_sharded(state, folder, *args, **kwargs)


weights.save_sharded = save_sharded

if __name__ == "__main__":
    from reelcache.train.cli import main

    sys.exit(main())
