"""reelcache.base: the floor beneath every stage, what they all share and that touches no database.

The unit runner and its claim (``units.py``), leases (``lease.py``), shards and atomic publishing
(``shards.py``), the latent sample format and its one reader (``latents.py``), bucket geometry and
Open-Sora 1.2's tables (``buckets.py``, ``aspect_tables.py``). It imports only the ground floor,
``reelcache/``; the DuckDB catalog stands on it (docs/DESIGN.md, "Floors").
"""
