"""Online serving: the async engine front and the OpenAI-compatible HTTP server (`nanovllm serve`)."""
