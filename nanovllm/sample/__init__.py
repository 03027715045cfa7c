"""Sampling: per-row metadata built from the batch, and the batched sampler."""
