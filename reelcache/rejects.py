"""Why a row is rejected: the one vocabulary of every stage's ``reject_reason``.

A unit's sidecar records a reject as the value of one of these (the catalog's ``clips.reject_reason`` for
ingest, ``latents.reject_reason`` for the cache); the unit runner (base/units.py) names a worker that
timed out, died or failed to read its input ``timeout``, ``crashed`` or ``undecodable``, whichever stage
it runs. A reason means the same wherever it appears; the comment after each says who records it.
"""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    # ingest: the table row (ingest/filters.py)
    bad_row = "bad_row"  # the table row itself is malformed (no path, wrong field count)
    duplicate_row = "duplicate_row"  # same path listed again in the same source
    empty_caption = "empty_caption"  # no caption text
    # ingest: the file, before and while it is probed (ingest/probe.py, ingest/filters.py)
    missing_file = "missing_file"  # path does not exist (or is not a regular file)
    empty_file = "empty_file"  # zero bytes
    too_large = "too_large"  # file over --max-file-mb
    no_video_stream = "no_video_stream"  # container has no video stream (audio only, image sequence...)
    truncated = "truncated"  # index points past the end of file / fewer frames than stated
    too_short = "too_short"  # fewer than --min-frames frames or --min-seconds
    # the cache: a clip that fits no bucket (base/buckets.py says why; cache/outputs.py records it)
    no_bucket_too_small = "no_bucket:too_small"  # fewer pixels than 0.8 x the smallest resolution's budget
    no_bucket_too_short = "no_bucket:too_short"  # large enough, but fewer frames than any bucket's span
    no_bucket_not_kept = "no_bucket:not_kept"  # it fits buckets, but their keep-probability draws dropped it
    # the cache: the encoder's output (cache/run.py)
    invalid_latent = "invalid_latent"  # the VAE gave non-finite values (NaN, inf): nothing stored
    # both stages: the isolated worker (base/units.py, reelcache/isolate.py)
    undecodable = "undecodable"  # FFmpeg cannot read the container or bitstream (ingest's probe, the cache's decode)
    timeout = "timeout"  # the probe or decode did not finish within its time limit; its worker was killed
    crashed = "crashed"  # the worker died on it (a decoder crash, worker_memory_mb exceeded)
    # both stages: a takedown (lineage/takedown.py)
    withdrawn = "withdrawn"  # a takedown withdrew the clip: ingest refuses its video again (its content hash),
    # the cache's row says its latent was removed
