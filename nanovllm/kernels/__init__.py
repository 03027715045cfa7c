"""Triton kernels of the engine (attention, KV store). Imported lazily by the backends that use them."""
