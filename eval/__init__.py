"""reelcache.eval: watches a training run's checkpoints and evaluates them off the training nodes.

The stage after train: it composes the cache's encoders (text encoder; the VAE's decode)
with the trainer's model and sampler, so it is the one stage allowed to import both.
"""
