"""Offline batch inference over Ray Data: NanoVLLMPredictor, the callable class that
`Dataset.map_batches` runs in a pool of actors (one LLM each); resources_per_actor() and
generate_dataset() wire it up. Ray is imported only by the functions that need it.

    ds.map_batches(NanoVLLMPredictor, fn_constructor_kwargs={"model": DIR, **engine_options},
                   compute=ray.data.ActorPoolStrategy(size=N), batch_size=B,
                   **resources_per_actor(tensor_parallel_size))
"""
import dataclasses
import logging

from nanovllm.integrations.columns import (num_rows, output_columns, read_batch, read_prompts,
                                           read_sampling_params, write_batch)
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'nano-vllm[ray]'"


def import_ray():
    """The ray module, with Ray Data loaded; a clear ImportError naming the extra when absent."""
    try:
        import ray
        import ray.data  # noqa: F401  (the extra is ray[data]: ray alone lacks pandas/pyarrow)
    except ImportError as e:
        raise ImportError(f"nanovllm.integrations.ray needs Ray Data, which is not installed ({e}); "
                          f"install it with: {INSTALL_HINT}") from e
    return ray


def default_fields(sampling_params: SamplingParams | dict | None) -> dict:
    """Every row's default SamplingParams fields, checked by building them once."""
    if sampling_params is None:
        fields = {}
    elif isinstance(sampling_params, dict):
        fields = dict(sampling_params)
    elif isinstance(sampling_params, SamplingParams):
        fields = {f.name: getattr(sampling_params, f.name) for f in dataclasses.fields(SamplingParams)}
    else:
        raise TypeError(f"sampling_params must be a SamplingParams, a dict of its fields or None, "
                        f"got {type(sampling_params).__name__}")
    params = SamplingParams(**fields)
    if params.n != 1 or params.logprobs is not None:
        raise ValueError(f"sampling_params must keep n=1 and logprobs=None (one output row per input row, "
                         f"no logprobs column), got n={params.n}, logprobs={params.logprobs}")
    return fields


class NanoVLLMPredictor:
    """One engine per Ray actor; each call turns a batch of prompts into a batch of outputs.

    Constructor (Ray passes `fn_constructor_kwargs`): `model`, the checkpoint folder; optional
    `sampling_params` (a SamplingParams or a dict of its fields), every row's defaults; any other
    keyword is an LLM engine option (`tensor_parallel_size`, `max_model_len`, `dtype`, ...).

    Input columns: `prompt` (text) or `prompt_token_ids` (lists of ints): each row sets one. Optional
    per-row sampling: a column per SamplingParams field (`max_tokens`, `temperature`, `top_p`,
    `seed`, `stop`, ...; not `n` or `logprobs`), or a `sampling_params` column of dicts; a missing
    value (None/NaN, as columnar files store absent keys) keeps the default.
    Output: the input columns plus `generated_text`, `generated_token_ids`, `num_prompt_tokens`,
    `num_generated_tokens`, `finish_reason`, row for row.

    NOTE: with tensor_parallel_size N the engine spawns N-1 worker processes inside the actor
    (multiprocessing's `spawn` context, which a Ray actor can use); reserve N CPUs (and N GPUs on
    CUDA) per actor with resources_per_actor(N), or the ranks of several actors share cores.
    """

    def __init__(self, model: str, sampling_params: SamplingParams | dict | None = None, **engine_options):
        self.default_fields = default_fields(sampling_params)
        self.llm = LLM(model, **engine_options)
        logger.info("engine ready in this actor: %s, tensor_parallel_size=%d", model,
                    self.llm.config.tensor_parallel_size)

    def __call__(self, batch):
        columns = read_batch(batch)
        n = num_rows(columns)
        prompts = read_prompts(columns, n)
        params = read_sampling_params(columns, n, self.default_fields)
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if n else []
        return write_batch(batch, columns, output_columns(outputs))

    def exit(self) -> None:
        """Ends the engine (and its tensor-parallel workers); actor exit does it too."""
        self.llm.exit()


def resources_per_actor(tensor_parallel_size: int = 1, use_gpu: bool = False) -> dict[str, int]:
    """map_batches' `num_cpus` / `num_gpus` for one actor: a CPU per rank (each rank is a process),
    and a GPU per rank when the engine runs on CUDA (Ray then sets CUDA_VISIBLE_DEVICES to them)."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    return {"num_cpus": tensor_parallel_size, "num_gpus": tensor_parallel_size if use_gpu else 0}


def generate_dataset(dataset, model: str, *, concurrency: int = 1, batch_size: int = 64,
                     sampling_params: SamplingParams | dict | None = None, use_gpu: bool = False,
                     **engine_options):
    """`dataset` with the output columns added: map_batches over `concurrency` NanoVLLMPredictor
    actors (batches of `batch_size` rows), each reserving resources_per_actor(tensor_parallel_size)."""
    ray = import_ray()
    default_fields(sampling_params)  # a bad value fails here, not in every actor
    resources = resources_per_actor(engine_options.get("tensor_parallel_size", 1), use_gpu)
    # A fixed pool of `concurrency` actors (map_batches' `concurrency=` says the same, deprecated in Ray 2.51).
    pool = ray.data.ActorPoolStrategy(size=concurrency)
    return dataset.map_batches(NanoVLLMPredictor, compute=pool, batch_size=batch_size,
                               fn_constructor_kwargs=dict(engine_options, model=model, sampling_params=sampling_params),
                               **resources)
