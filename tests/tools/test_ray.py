"""Ray Data integration (nanovllm/integrations/ray.py): the predictor on each batch format against a
plain LLM, its column errors and its missing-Ray error (no Ray needed), then a local Ray cluster:
two actors give a single engine's greedy outputs row for row, TP=2 inside an actor, a clean shutdown."""
import importlib.util
import os
import sys
import time

import numpy as np
import pytest

import nanovllm
from nanovllm import LLM, SamplingParams
from nanovllm.integrations.ray import NanoVLLMPredictor, generate_dataset, import_ray, resources_per_actor

def is_importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


NO_RAY = "ray is not installed (pip install 'nano-vllm[ray]')"
needs_ray = pytest.mark.skipif(not is_importable("ray"), reason=NO_RAY)

ENGINE = dict(max_model_len=64, cpu_kvcache_bytes=4 * 2**20)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
TEXTS = ["the quick brown fox", "seven bright stars shine above", "old quiet rivers and small green hills",
         "people talk"]
TOKEN_PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24], [9, 9]]


@pytest.fixture(scope="module")
def predictor(qwen3_gqa):
    p = NanoVLLMPredictor(qwen3_gqa, sampling_params=GREEDY, **ENGINE)
    yield p
    p.exit()


@pytest.fixture(scope="module")
def reference(qwen3_gqa):
    with LLM(qwen3_gqa, **ENGINE) as llm:
        yield llm


def expected_rows(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[dict]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [{"generated_text": o["text"], "generated_token_ids": list(o["token_ids"]),
             "num_prompt_tokens": len(o["prompt_token_ids"]), "num_generated_tokens": len(o["token_ids"]),
             "finish_reason": o["finish_reason"]} for o in outs]


def rows_of(columns, names) -> list[dict]:
    n = len(columns[names[0]])
    return [{name: (list(columns[name][i]) if name == "generated_token_ids" else columns[name][i])
             for name in names} for i in range(n)]


OUTPUT_NAMES = ["generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens",
                "finish_reason"]


# ---- the predictor in this process ---------------------------------------------------------------
def test_dict_batch_matches_llm_with_per_row_sampling(predictor, reference):
    batch = {"id": np.arange(3), "prompt": np.array(TEXTS[:3], dtype=object),
             "max_tokens": np.array([2, 5, 3]),
             "temperature": np.array([0.0, 0.9, np.nan]), "seed": np.array([np.nan, 7.0, np.nan]),
             "stop": np.array([None, None, ["hills"]], dtype=object)}
    out = predictor(batch)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2),
              SamplingParams(temperature=0.9, ignore_eos=True, max_tokens=5, seed=7),
              SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3, stop=["hills"])]
    assert rows_of(out, OUTPUT_NAMES) == expected_rows(reference, TEXTS[:3], params)
    assert list(out["id"]) == [0, 1, 2] and list(out["prompt"]) == TEXTS[:3]  # passed through
    assert list(out["num_generated_tokens"])[:2] == [2, 5]


def test_token_id_prompts_and_sampling_params_column(predictor, reference):
    batch = {"prompt_token_ids": np.array([np.array(p) for p in TOKEN_PROMPTS] + [None], dtype=object),
             "prompt": np.array([None, None, None, "people talk"], dtype=object),
             "sampling_params": np.array([{"max_tokens": 4}, None, {"max_tokens": 1, "top_k": None},
                                          {"temperature": 0.5, "seed": 3, "max_tokens": 6}], dtype=object)}
    out = predictor(batch)
    prompts = TOKEN_PROMPTS + ["people talk"]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), GREEDY,
              SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1),
              SamplingParams(temperature=0.5, ignore_eos=True, seed=3, max_tokens=6)]
    assert rows_of(out, OUTPUT_NAMES) == expected_rows(reference, prompts, params)
    assert list(out["num_generated_tokens"]) == [4, 8, 1, 6]
    assert list(out["num_prompt_tokens"])[:3] == [3, 5, 2]


def test_pandas_and_arrow_batches(predictor, reference):
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    frame = pd.DataFrame({"prompt": TEXTS, "max_tokens": [3, None, 2, 4]})  # the gap makes floats
    out = predictor(frame)
    assert isinstance(out, pd.DataFrame) and list(out.index) == list(frame.index)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in (3, 8, 2, 4)]
    expected = expected_rows(reference, TEXTS, params)
    assert rows_of({c: out[c].tolist() for c in out.columns}, OUTPUT_NAMES) == expected
    table = pa.table({"prompt": TEXTS, "max_tokens": [3, None, 2, 4]})
    assert rows_of(predictor(table), OUTPUT_NAMES) == expected


def test_row_keeps_defaults_that_greedy_normalization_drops(qwen3_gqa, reference):
    # A greedy default drops top_p inside SamplingParams; a row that raises the temperature must
    # still sample with the default top_p it was given.
    p = NanoVLLMPredictor(qwen3_gqa, sampling_params={"temperature": 0.0, "top_p": 0.3, "max_tokens": 8,
                                                      "ignore_eos": True}, **ENGINE)
    try:
        out = p({"prompt": np.array(TEXTS, dtype=object), "temperature": np.full(4, 1.5), "seed": np.arange(4)})
    finally:
        p.exit()
    kept, dropped = ([SamplingParams(temperature=1.5, top_p=top_p, max_tokens=8, ignore_eos=True, seed=i)
                      for i in range(4)] for top_p in (0.3, 1.0))
    assert rows_of(out, OUTPUT_NAMES) == expected_rows(reference, TEXTS, kept)
    assert expected_rows(reference, TEXTS, kept) != expected_rows(reference, TEXTS, dropped)


def test_empty_batch(predictor):
    out = predictor({"prompt": np.array([], dtype=object)})
    assert all(len(out[name]) == 0 for name in OUTPUT_NAMES)


@pytest.mark.parametrize("batch, words", [
    ({"text": np.array(["hi"], dtype=object)}, ["no 'prompt'", "'prompt_token_ids'", "text"]),
    ({"prompt": np.array(["the fox"], dtype=object), "prompt_token_ids": np.array([[5, 6]])}, ["row 0", "both"]),
    ({"prompt": np.array([None], dtype=object)}, ["row 0", "neither"]),
    ({"prompt": np.array([3])}, ["row 0", "column 'prompt'", "strings"]),
    ({"prompt": np.array([""], dtype=object)}, ["column 'prompt'", "empty"]),
    ({"prompt_token_ids": np.array([[1.5, 2.0]])}, ["column 'prompt_token_ids'", "ints"]),
    ({"prompt_token_ids": np.array(["the fox"], dtype=object)}, ["column 'prompt_token_ids'", "str"]),
    ({"prompt": np.array(["the fox"], dtype=object), "temperature": np.array([-1.0])},
     ["row 0", "'temperature'", "temperature must be"]),
    ({"prompt": np.array(["the fox"], dtype=object), "max_tokens": np.array([2.5])}, ["'max_tokens'", "int"]),
    ({"prompt": np.array(["the fox"], dtype=object), "sampling_params": np.array([{"beam": 2}], dtype=object)},
     ["column 'sampling_params'", "beam"]),
    ({"prompt": np.array(["the fox"], dtype=object), "sampling_params": np.array(["greedy"], dtype=object)},
     ["column 'sampling_params'", "dicts"]),
    ({"prompt": np.array(["the fox"], dtype=object), "max_tokens": np.array([2]),
      "sampling_params": np.array([{"max_tokens": 3}], dtype=object)}, ["max_tokens", "both"]),
    ({"prompt": np.array(["the fox"], dtype=object), "generated_text": np.array(["x"], dtype=object)},
     ["generated_text", "overwritten"]),
    ({"prompt": np.array(["a", "b"], dtype=object), "max_tokens": np.array([1])}, ["length"]),
])
def test_bad_columns_raise_value_error_naming_them(predictor, batch, words):
    with pytest.raises(ValueError) as e:
        predictor(batch)
    for word in words:
        assert word in str(e.value)


def test_bad_arguments(predictor, qwen3_gqa):
    with pytest.raises(TypeError, match="batch must be"):
        predictor([{"prompt": "x"}])
    with pytest.raises(TypeError, match="sampling_params must be"):
        NanoVLLMPredictor(qwen3_gqa, sampling_params=0.5)
    with pytest.raises(ValueError, match="temperature"):
        NanoVLLMPredictor(qwen3_gqa, sampling_params={"temperature": -1})
    for bad in ({"n": 2}, SamplingParams(logprobs=1)):
        with pytest.raises(ValueError, match="n=1 and logprobs=None"):
            NanoVLLMPredictor(qwen3_gqa, sampling_params=bad)
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        resources_per_actor(0)
    assert resources_per_actor(2) == {"num_cpus": 2, "num_gpus": 0}
    assert resources_per_actor(2, use_gpu=True) == {"num_cpus": 2, "num_gpus": 2}


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    for call in (import_ray, lambda: generate_dataset(None, "model")):
        with pytest.raises(ImportError, match=r"pip install 'nano-vllm\[ray\]'"):
            call()


# ---- a local Ray cluster -------------------------------------------------------------------------
def descendants() -> dict[int, str]:
    import psutil
    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            found[p.pid] = p.name()
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason=NO_RAY)
    pytest.importorskip("psutil", reason="the shutdown check lists processes with psutil")
    before = set(descendants())
    root = os.path.dirname(os.path.dirname(nanovllm.__file__))
    # Small and quiet: no dashboard, a small object store; actors import this checkout's nanovllm.
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": root, "OMP_WAIT_POLICY": "PASSIVE"}})
    context = ray.data.DataContext.get_current()
    old_order = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    started = {pid: name for pid, name in descendants().items() if pid not in before}
    yield ray, before, started
    context.execution_options.preserve_order = old_order
    ray.shutdown()


def mixed_rows() -> tuple[list[dict], list, list[int]]:
    """Rows mixing text and token-id prompts, each with its own max_tokens."""
    prompts = [p for pair in zip(TEXTS, TOKEN_PROMPTS + [[30, 31]]) for p in pair]
    max_tokens = [2 + i % 5 for i in range(len(prompts))]
    rows = [{"id": i, "prompt": p if isinstance(p, str) else None,
             "prompt_token_ids": p if isinstance(p, list) else None, "max_tokens": m}
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    return rows, prompts, max_tokens


def check_rows(got: list[dict], reference: LLM, prompts: list, max_tokens: list[int]) -> None:
    assert [row["id"] for row in got] == list(range(len(prompts)))  # in order
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    assert [{name: row[name] for name in OUTPUT_NAMES} for row in got] == expected_rows(reference, prompts, params)
    assert [row["num_generated_tokens"] for row in got] == max_tokens


@needs_ray
def test_two_actors_match_one_engine(ray_cluster, qwen3_gqa, reference):
    ray = ray_cluster[0]
    rows, prompts, max_tokens = mixed_rows()
    ds = ray.data.from_items(rows).map_batches(
        NanoVLLMPredictor, compute=ray.data.ActorPoolStrategy(size=2), batch_size=3, num_cpus=1,
        fn_constructor_kwargs=dict(ENGINE, model=qwen3_gqa, sampling_params=GREEDY))
    got = [dict(row, generated_token_ids=list(row["generated_token_ids"])) for row in ds.take_all()]
    check_rows(got, reference, prompts, max_tokens)
    assert all(row["finish_reason"] == "length" for row in got)


@needs_ray
@pytest.mark.slow
def test_tensor_parallel_inside_an_actor(ray_cluster, qwen3_gqa, reference):
    ray = ray_cluster[0]
    rows, prompts, max_tokens = mixed_rows()
    ds = generate_dataset(ray.data.from_items(rows), qwen3_gqa, concurrency=1, batch_size=4,
                          sampling_params=GREEDY, tensor_parallel_size=2, **ENGINE)
    got = [dict(row, generated_token_ids=list(row["generated_token_ids"])) for row in ds.take_all()]
    check_rows(got, reference, prompts, max_tokens)


@needs_ray
def test_cluster_shuts_down_clean(ray_cluster):
    ray, before, started = ray_cluster
    assert {"raylet", "gcs_server"} <= set(started.values())  # the check below would see them
    alive = set(descendants()) - before  # everything Ray started since, actors and TP workers included
    ray.shutdown()
    deadline = time.monotonic() + 15
    while (left := {pid: name for pid, name in descendants().items() if pid in alive or pid in started}) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after ray.shutdown(): {left}"
    assert not ray.is_initialized()
