"""The engine core's pure-Python parts: requests as sequences, the scheduler, the KV block
pool with its prefix cache, sampling parameters and incremental detokenizing. Nothing here
touches a device: the scheduler works on token counts and block ids, so it is unit-tested
with no model."""
