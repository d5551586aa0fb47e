"""The data layer: the hash ring that deals samples to ranks (hash_ring.py), the elastic
sampler that gives every sample to exactly one rank per epoch through membership changes
(sampler.py), and the sample cache (cache.py). numpy only: torch is imported where a
DataLoader needs it, never by these modules at import."""
