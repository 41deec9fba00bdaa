"""reelcache.cluster.slurm: every command that submits to Slurm, with one option set and one script template.

Three kinds of job, one way to describe and check them:

- ``reelcache slurm submit``: a plan's units (ingest, cache) as one job array, a ``--then`` job
  after it (``array``);
- ``reelcache train ... --slurm``: the training as one requeueable job of N nodes (``jobs``);
- ``reelcache eval serve ... --slurm``: the evaluation server beside it (``jobs``).

Modules: ``options`` (the option set every submitting command takes, ``--partition``, ``--account``,
``--time``, ``--mem``, ``--cpus-per-task``, ``--job-name``, ``--sbatch-arg``, ``--dry-run``, and each
kind's own, typed as ``Resources``), ``script`` (the one template every job script is rendered from,
writing it and ``sbatch``), ``checks`` (what would make sbatch refuse a job, or leave it pending for
ever, as one line before anything is submitted), ``client`` (running Slurm's commands and reading
their answers), ``array`` and ``jobs``. Standard library only: the parsers build without torch, and
the commands run on a login node.
"""
