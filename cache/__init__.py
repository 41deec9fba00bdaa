"""reelcache.cache: VAE and T5 latents precomputed once into latent shards, keyed by encoder identity.

Same shape as ingest: ``plan`` -> ``run UNIT`` on many GPU nodes (GNU parallel or a Slurm job
array) -> ``catalog merge``.
"""
