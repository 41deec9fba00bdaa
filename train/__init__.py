"""reelcache.train: streaming loader over latent shards and the ColossalAI trainer (not built yet)."""
