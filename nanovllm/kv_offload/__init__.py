"""A tier under the prefix cache (vLLM's KV offloading; LMCache's disk backend): every hashed block's
K/V written through to host RAM and / or a directory, so that a prefix evicted from the engine's cache,
or computed by an earlier process or by a replica sharing the directory, is read back instead of
prefilled again.

- block_file.py: one block's file: a header naming what it holds, its K/V bytes, a checksum.
- stores.py: RamStore (LRU in host RAM) and DiskStore (a directory bounded in bytes, atomic writes,
  LRU eviction by the process that owns the directory).
- fingerprint.py: what makes a block's bytes what they are (weights, KV format, layers, TP, rope).
- tier.py: KVTier: lookups for the KV cache manager, writes and reads on a worker thread.
- connector.py: between steps, moves finished reads into the cache and new blocks out (through the
  Executor), so that neither the scheduler nor the manager touches a tensor.
"""
