"""Sampling: per-row metadata built from the batch, the batched sampler, structured-output grammars."""
