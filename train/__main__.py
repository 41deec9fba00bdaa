"""``python -m reelcache.train CONFIG --root R ...``: the entry point a launcher starts on every rank."""

import sys

from reelcache.train.cli import main

sys.exit(main())
