"""The server's Prometheus metrics (vLLM's names) in a registry of its own per app, and
MeteredGeneration, the Generation that records them. openai_server.py serves them on /metrics.

NOTE: counters and histograms change on the event loop only; the gauges are read from the engine
thread (AsyncEngine.call) at each scrape, so nothing here touches the engine from the loop.
"""
import time

from nanovllm.entrypoints.serving import Generation

# Seconds; the same buckets for first-token, inter-token and end-to-end latency would waste most.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """One app's metrics, labelled with the served model name."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.model_name = model_name
        common = dict(labelnames=["model_name"], registry=self.registry)

        def one(metric_cls, name: str, doc: str, **kwargs):
            return metric_cls(name, doc, **common, **kwargs).labels(model_name=model_name)

        self.num_running = one(Gauge, "vllm:num_requests_running", "Sequences in the running batch.")
        self.num_waiting = one(Gauge, "vllm:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage = one(Gauge, "vllm:kv_cache_usage_perc", "KV cache usage: 1 means every block is used.")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds",
                        "From request arrival to a completion's first token.", buckets=TTFT_BUCKETS)
        self.itl = one(Histogram, "vllm:inter_token_latency_seconds",
                       "Between a completion's successive tokens.", buckets=ITL_BUCKETS)
        self.e2e = one(Histogram, "vllm:e2e_request_latency_seconds",
                       "From request arrival to its last token.", buckets=E2E_BUCKETS)
        # Speculative decoding (spec_decode/metrics.py), counted by the engine and carried over at
        # each scrape; only with speculation on (spec_counters is None until the first scrape).
        self.spec_counters: dict | None = None
        self.spec_seen: dict[str, int] = {}
        # The tier under the prefix cache (kv_offload/tier.py TierStats), carried over the same way.
        self.tier_counters: dict | None = None
        self.tier_seen: dict[str, int] = {}

    # TierStats field -> (metric name: vLLM's where it has one, help)
    TIER_METRICS = {
        "query_tokens": ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the KV offloading tier."),
        "hit_tokens": ("vllm:external_prefix_cache_hits", "Prompt tokens read back from the KV offloading tier."),
        "bytes_read": ("vllm:kv_offload_load_bytes", "Bytes of K/V read from the KV offloading tier's directory."),
        "bytes_written": ("vllm:kv_offload_store_bytes", "Bytes of K/V written to the KV offloading tier's directory."),
        "writes_dropped": ("nanovllm:kv_offload_writes_dropped", "Blocks not written: the tier's queue was full."),
        "bad_files": ("nanovllm:kv_offload_bad_files", "Damaged or foreign block files found (deleted, recomputed)."),
        "io_errors": ("nanovllm:kv_offload_io_errors", "Tier reads or writes that failed."),
    }

    def _carry_tier(self, stats: dict | None) -> None:
        if stats is None:
            return
        from prometheus_client import Counter
        if self.tier_counters is None:
            common = dict(labelnames=["model_name"], registry=self.registry)
            self.tier_counters = {key: Counter(name, doc, **common).labels(model_name=self.model_name)
                                  for key, (name, doc) in self.TIER_METRICS.items()}
        for key, counter in self.tier_counters.items():
            if stats[key] > self.tier_seen.get(key, 0):
                counter.inc(stats[key] - self.tier_seen.get(key, 0))
                self.tier_seen[key] = stats[key]

    def _spec_counters(self, num_positions: int) -> dict:
        from prometheus_client import Counter
        common = dict(labelnames=["model_name"], registry=self.registry)
        names = {"num_drafts": "Verifications of a sequence that had proposals.",
                 "num_draft_tokens": "Proposed tokens verified.",
                 "num_accepted_tokens": "Proposed tokens accepted.",
                 "num_emitted_tokens": "Tokens emitted by verifications (accepted + the target's own)."}
        counters = {key: Counter(f"vllm:spec_decode_{key}", doc, **common).labels(model_name=self.model_name)
                    for key, doc in names.items()}
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted proposals at each position.",
                          labelnames=["model_name", "position"], registry=self.registry)
        for j in range(num_positions):
            counters[f"pos{j}"] = per_pos.labels(model_name=self.model_name, position=str(j))
        return counters

    def _carry_spec(self, counts: dict | None) -> None:
        if counts is None:
            return
        per_pos = counts.pop("accepted_per_position")
        if self.spec_counters is None:
            self.spec_counters = self._spec_counters(len(per_pos))
        counts.update({f"pos{j}": n for j, n in enumerate(per_pos)})
        for key, value in counts.items():
            if key in self.spec_counters and value > self.spec_seen.get(key, 0):
                self.spec_counters[key].inc(value - self.spec_seen.get(key, 0))
                self.spec_seen[key] = value

    async def refresh_gauges(self, engine) -> None:
        """Read the scheduler's queues and the KV cache use between two engine steps."""
        def read(llm) -> tuple[int, int, float, dict | None, dict | None]:
            free, total = llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks, llm.llm_engine.num_kvcache_blocks
            waiting = (len(llm.llm_engine.scheduler.waiting) + len(llm.llm_engine.scheduler.loading)
                       + len(llm.llm_engine.pending_siblings))
            spec = llm.llm_engine.speculator.metrics.as_dict() if llm.llm_engine.speculator is not None else None
            connector = llm.llm_engine.connector
            tier = connector.tier.stats.as_dict() if connector is not None else None
            return len(llm.llm_engine.scheduler.running), waiting, 1.0 - free / total if total else 0.0, spec, tier

        running, waiting, usage, spec, tier = await engine.call(read)
        self.num_running.set(running)
        self.num_waiting.set(waiting)
        self.kv_cache_usage.set(usage)
        self._carry_spec(spec)
        self._carry_tier(tier)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


class MeteredGeneration(Generation):
    """A Generation that counts its tokens and times its completions into ServerMetrics."""

    def __init__(self, *args, metrics: ServerMetrics, arrival: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.metrics = metrics
        self.arrival = arrival  # time.perf_counter() when the HTTP request came in
        self.last_token_at: dict[int, float] = {}  # choice index -> time of its latest token

    async def submit(self, prompts: list, sampling_params) -> None:
        await super().submit(prompts, sampling_params)
        self.metrics.prompt_tokens.inc(sum(self.prompt_lens))

    async def deltas(self):
        inner = super().deltas()
        try:
            async for choice, delta, entries in inner:
                self._record(choice.index, len(delta.token_ids))
                yield choice, delta, entries
            self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        finally:
            await inner.aclose()  # runs Generation.deltas' abort of what is unfinished

    def _record(self, index: int, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(num_tokens)
        previous = self.last_token_at.get(index)
        gap = 0.0 if previous is None else now - previous
        if previous is None:
            self.metrics.ttft.observe(now - self.arrival)
            num_tokens -= 1
        # Tokens that arrive together (merged deltas) share the gap since the previous one.
        for _ in range(num_tokens):
            self.metrics.itl.observe(gap / num_tokens)
        self.last_token_at[index] = now
