"""Running the engine inside other engines: `ray` (Ray Data's map_batches, one LLM per actor).
Each integration imports its outside framework lazily, so this package imports without them."""
