"""reelcache.train: the streaming loader over latent shards and the STDiT3 trainer on ColossalAI."""
