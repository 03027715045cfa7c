"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's tokens, each rank loads its slice of the
checkpoint, and engines always end their workers and free their shared memory."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from multiprocessing import shared_memory

import pytest
import torch
from safetensors.torch import load_file

from helpers import hf_greedy
from process_helpers import free_ports
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.distributed.tp_worker import HOST, CallChannel, listening_store
from tp_workloads import BLOCK, GREEDY, kv_block_bytes, run_mixed_workload, workers_of  # noqa: E402


@pytest.fixture
def gqa(qwen3_gqa) -> str:
    return qwen3_gqa


@pytest.fixture
def bias_tied(qwen3_bias_tied) -> str:
    return qwen3_bias_tied


def shm_exists(name: str) -> bool:
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    shm.close()
    return True


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_cleaned_up(worker_pids: list[int], shm_name: str) -> None:
    assert mp.active_children() == []
    assert not any(pid_exists(pid) for pid in worker_pids)
    assert not shm_exists(shm_name)
    assert not torch.distributed.is_initialized()


# ---- sharded weight loading (in-process: the layers read a patched rank and world size) ------
def build_shard(path: str, rank: int, monkeypatch) -> torch.nn.Module:
    from nanovllm.layers import embed_head, linear
    from nanovllm.models import get_model_class
    from nanovllm.loader import load_model

    for module in (linear, embed_head):
        monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tp_size", lambda: 2)
    hf_config = Config(path, dtype="float32").hf_config
    model = get_model_class(hf_config)(hf_config).float()
    load_model(model, path)
    return model


@pytest.mark.parametrize("shape", ["gqa", "bias_tied"])
def test_each_rank_loads_its_slice(shape, gqa, bias_tied, monkeypatch):
    path = {"gqa": gqa, "bias_tied": bias_tied}[shape]
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    for rank in (0, 1):
        params = dict(build_shard(path, rank, monkeypatch).named_parameters(remove_duplicate=False))

        def half(name: str, dim: int) -> torch.Tensor:
            return ckpt[name].chunk(2, dim=dim)[rank]

        expected = {}
        for name, tensor in ckpt.items():
            prefix, _, kind = name.rpartition(".")
            if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                continue  # packed below
            if "o_proj" in name or "down_proj" in name:
                expected[name] = half(name, 1) if kind == "weight" else tensor
            elif "embed_tokens" in name or "lm_head" in name:
                expected[name] = half(name, 0)
            else:
                expected[name] = tensor  # norms are replicated
        for i in range(len([n for n in ckpt if n.endswith("input_layernorm.weight")])):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for kind in ("weight", "bias"):
                if f"{attn}.q_proj.{kind}" in ckpt:
                    expected[f"{attn}.qkv_proj.{kind}"] = torch.cat(
                        [half(f"{attn}.{p}_proj.{kind}", 0) for p in "qkv"])
            expected[f"{mlp}.gate_up_proj.weight"] = torch.cat(
                [half(f"{mlp}.gate_proj.weight", 0), half(f"{mlp}.up_proj.weight", 0)])
        if "lm_head.weight" not in ckpt:  # tied: the head is the embedding's slice
            expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        assert sorted(params) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), (rank, name)


def test_row_parallel_bias_is_loaded_whole(monkeypatch):
    from nanovllm.layers import linear

    weight, bias = torch.randn(6, 8), torch.randn(6)
    for rank in (0, 1):
        monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(linear, "get_tp_size", lambda: 2)
        layer = linear.RowParallelLinear(8, 6, bias=True)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        assert torch.equal(layer.weight, weight[:, 4 * rank: 4 * rank + 4])
        assert torch.equal(layer.bias, bias)


# ---- configuration and the call channel -------------------------------------------------------
def test_tp_size_is_validated(gqa, monkeypatch):
    with pytest.raises(ValueError, match="num_attention_heads"):
        Config(gqa, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Config(gqa, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="dist_port"):
        Config(gqa, tensor_parallel_size=2, dist_port=70000)
    with pytest.raises(ValueError, match="dist_shm_name"):
        Config(gqa, tensor_parallel_size=2, dist_shm_name="a/b")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="exceeds the 1 visible CUDA"):
        Config(gqa, device="cuda", tensor_parallel_size=2)


def test_tp1_engine_refuses_to_share_a_process_with_a_running_group(gqa, monkeypatch):
    from nanovllm.executor import model_runner

    monkeypatch.setattr(model_runner.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(model_runner.dist, "get_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="group of 2 ranks is already running"):
        LLM(gqa)


def test_channel_refuses_unlisted_methods_and_oversized_calls():
    name = f"nanovllm-test-{uuid.uuid4().hex[:12]}"
    owner = CallChannel(name, 4096)
    try:
        reader = CallChannel(name)
        owner.write("run", ([1, 2, 3],))
        assert reader.read() == ("run", ([1, 2, 3],))
        owner.write("load_model", ("/tmp/evil",))
        with pytest.raises(ValueError, match="refusing to call ModelRunner.load_model"):
            reader.read()
        with pytest.raises(RuntimeError, match="bytes of shared memory"):
            owner.write("run", (list(range(4096)),))
        reader.close()
    finally:
        owner.close()
    assert not shm_exists(name)


def build_runner_rank(config: Config, rank: int, port: int, results) -> None:
    """One rank of a 2-rank gloo group started by the test itself (spawned; module-level to pickle)."""
    import torch.distributed as dist
    from nanovllm.executor.model_runner import ModelRunner
    from nanovllm.distributed.tp_worker import HOST, init_process_group

    store = dist.TCPStore(HOST, port, 2, is_master=False)
    init_process_group(config, rank, store)
    runner = ModelRunner(config, rank)
    results.put((rank, runner.num_kvcache_blocks, runner.kv_cache.shape[2]))
    dist.destroy_process_group()


def test_ranks_agree_on_the_smallest_kv_block_count(gqa):
    """Rank 1's budget fits 7 blocks, rank 0's 10: both must allocate 7 (rank 0 schedules for all)."""
    import copy
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for rank, num_blocks in ((0, 10), (1, 7)):
        config = copy.copy(Config(gqa, dtype="float32", kv_cache_dtype="float32", tensor_parallel_size=2,
                                  kvcache_block_size=BLOCK))
        config.cpu_kvcache_bytes = num_blocks * kv_block_bytes(gqa, tp=2)
        procs.append(ctx.Process(target=build_runner_rank, args=(config, rank, store.port, results)))
    try:
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == [(0, 7, 7), (1, 7, 7)]


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_tp2_matches_tp1_with_prefix_hits_chunks_and_preemption(gqa, kv):
    """Each rank holds its KV heads in the cache's format (int8: its own blocks of 32 per head)."""
    tokens1, steps1, preempted1, _, _ = run_mixed_workload(gqa, tp=1, kv=kv)
    tokens2, steps2, preempted2, pids, shm_name = run_mixed_workload(gqa, tp=2, kv=kv)
    assert_cleaned_up(pids, shm_name)
    assert len(pids) == 1
    for steps, preempted in ((steps1, preempted1), (steps2, preempted2)):
        prefills = [seq for is_prefill, seqs in steps if is_prefill for seq in seqs]
        assert any(cached == 2 * BLOCK for cached, *_ in prefills)  # prefix-cache hit
        assert any(computed + n < length for _, computed, n, length in prefills)  # a chunk
        assert preempted > 0
    assert tokens2 == tokens1
    assert all(len(t) in (8, 24) for t in tokens2)


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    psutil = pytest.importorskip("psutil")
    return {(c.laddr.ip, c.laddr.port) for pid in pids for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_a_single_node_engine_listens_on_loopback_only(gqa):
    """Its rendezvous store (torch's TCPStore listens on every interface unless handed a socket) and
    gloo's pair sockets, in rank 0 and the worker: 127.0.0.1 only, nothing on '::' or 0.0.0.0."""
    psutil = pytest.importorskip("psutil")
    with LLM(gqa, tensor_parallel_size=2, max_model_len=128, cpu_kvcache_bytes=1 << 22) as llm:
        me = psutil.Process()
        pids = [me.pid] + [c.pid for c in me.children(recursive=True)]
        addresses = listening_addresses(pids)
        assert (HOST, llm.llm_engine.model_runner.pool.store.port) in addresses
    assert addresses and {ip for ip, _ in addresses} == {HOST}, addresses


def test_node_zero_listens_on_the_dist_init_address():
    """Given another address (here 127.0.0.2, also this machine), the store listens there only."""
    import datetime
    store = listening_store("127.0.0.2", 0, 2, datetime.timedelta(seconds=5))
    try:
        assert ("127.0.0.2", store.port) in listening_addresses([os.getpid()])
        assert not any(port == store.port and ip != "127.0.0.2" for ip, port in listening_addresses([os.getpid()]))
    finally:
        del store


def test_engines_in_sequence_and_a_killed_worker(bias_tied):
    """A second TP engine (explicit port and shm name, bias + tied embeddings) gives HF's tokens;
    then SIGKILL of its worker mid-generate makes rank 0 raise, and the context manager cleans up."""
    port = free_ports(1)
    shm_name = f"nanovllm-test-{uuid.uuid4().hex[:12]}"
    prompts = [list(range(10, 30)), list(range(60, 67))]
    expected = [tokens for tokens, _ in hf_greedy(bias_tied, prompts, 10)]
    with pytest.raises(RuntimeError) as failure:
        with LLM(bias_tied, tensor_parallel_size=2, dtype="float32", dist_port=port,
                 dist_shm_name=shm_name, dist_timeout_s=120) as llm:
            assert shm_exists(shm_name)
            pids = [p.pid for p in workers_of(llm)]
            out = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
            assert [o["token_ids"] for o in out] == expected

            postprocess, steps = llm.llm_engine.scheduler.postprocess, []

            def kill_after_two_steps(*args):
                steps.append(1)
                if len(steps) == 2:
                    os.kill(pids[0], signal.SIGKILL)  # not waited for: the next step may still see it alive
                    failure_started.append(time.monotonic())
                return postprocess(*args)
            failure_started: list[float] = []
            llm.llm_engine.scheduler.postprocess = kill_after_two_steps
            llm.generate(prompts, SamplingParams(max_tokens=50, **GREEDY), use_tqdm=False)
    elapsed = time.monotonic() - failure_started[0]
    assert "nanovllm-tp-rank1" in str(failure.value) and "died" in str(failure.value)
    assert "exit code -9" in str(failure.value)
    assert elapsed < 30  # detected from the closed connection, not from dist_timeout_s
    assert_cleaned_up(pids, shm_name)


def test_garbage_collection_and_interpreter_exit_end_workers(gqa, tmp_path):
    """A script that drops one engine without exit(), then ends with another still open, leaves no
    worker and no shared memory behind."""
    script = tmp_path / "no_exit.py"
    script.write_text(textwrap.dedent(f"""
        import gc, os
        from multiprocessing import active_children
        from nanovllm import LLM, SamplingParams

        def start():
            llm = LLM({gqa!r}, tensor_parallel_size=2, dtype="float32")
            out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            assert len(out[0]["token_ids"]) == 4
            return llm, llm.llm_engine.model_runner.pool.workers[0].pid, llm.llm_engine.model_runner.pool.channel.name

        if __name__ == "__main__":
            llm, pid, name = start()
            del llm
            gc.collect()
            print("collected", pid, name, len(active_children()), os.path.exists("/dev/shm/" + name))
            llm, pid, name = start()
            print("open", pid, name, flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    collected, still_open = proc.stdout.splitlines()
    _, pid1, shm1, num_children, shm_left = collected.split()
    assert (num_children, shm_left) == ("0", "False")
    _, pid2, shm2 = still_open.split()
    assert shm1 != shm2
    for pid, shm in ((pid1, shm1), (pid2, shm2)):
        assert not pid_exists(int(pid))
        assert not shm_exists(shm)
    assert "leaked" not in proc.stderr
