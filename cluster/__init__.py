"""reelcache.cluster: ``reelcache cluster gpus|clocks|dump|stop``, the operator's checks before and during a run.

The replication lost days to operations, not to the model: stale processes from an earlier job
holding GPUs, NCCL crashing every 30 minutes because one node's clock ran backwards, a frozen
job found only by py-spy on every node, and a ``pkill -f python.*train.py`` that stops whatever
matches on every host. Each check here reads the hostfile that ingest, cache and the launcher
use, prints a table per node and exits 1 when something is wrong.

Modules: ``hosts`` (the hostfile and the transport to every node), ``agent`` (what runs on each
node, stdlib only), ``gpus``, ``clocks``, ``procs`` (dump and stop of one run's recorded ranks),
``ranks`` (the rank record every trainer rank writes and dump/stop read), ``slurm`` (every command
that submits to Slurm: one option set, one script template, the checks before submitting), ``cli``. Nothing here
imports torch or a stage other than ``catalog``: the checks run on a head node without them.
"""
