"""reelcache.eval: watches a training run's checkpoints and evaluates them off the training nodes.

The stage after train: it composes the cache's encoders and decoders (text encoder, VAE decoder)
with the trainer's model and sampler, so it is the one stage allowed to import both.
"""
