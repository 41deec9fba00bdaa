"""reelcache: the data path of a text-to-video training run.

Stages live in their own top-level folders and are imported as ``reelcache.ingest``,
``reelcache.catalog``, ``reelcache.cache``, ``reelcache.train``, ``reelcache.eval`` and
``reelcache.cluster``. This root package holds only what every stage shares: the CLI, errors,
settings, logging and progress reporting, isolated workers and how a video container is read
(``media``).
"""

__version__ = "0.1.0"


class UserError(ValueError):
    """Bad input or a refused operation: the message says what is wrong and what to do.

    The CLI prints it without a traceback and exits with status 2.
    """
