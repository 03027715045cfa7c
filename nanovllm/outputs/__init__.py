"""Per-request output handling: detokenization, stop strings, logprobs, streaming deltas, n > 1 siblings."""
