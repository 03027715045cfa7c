"""Tensor parallelism: rank 0's runner, the workers and their call channel, rank/world-size helpers."""
