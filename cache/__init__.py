"""reelcache.cache: VAE and T5 latents precomputed once into latent shards (not built yet).

Same shape as ingest: ``plan`` -> ``run UNIT`` on many GPU nodes -> ``catalog merge``.
"""
