"""Model execution: the ModelRunner (step inputs, forward, sample), decode CUDA graphs, compiled ops."""
