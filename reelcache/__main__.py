import sys

from reelcache.cli import main

sys.exit(main())
