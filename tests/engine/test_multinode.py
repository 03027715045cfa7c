"""Multi-node tensor parallelism on CPU (gloo): two "nodes" on 127.0.0.1 as separate process trees
(node 1 is `python -m nanovllm.cli worker`) give TP=1's tokens with the calls broadcast, not in
shared memory; rank 0's exit ends node 1; bad options and an unreachable rendezvous fail clearly."""
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.cli import main as cli_main
from nanovllm.config import Config
from nanovllm.distributed.broadcast_channel import BroadcastChannel
from nanovllm.distributed.node import run_node

from process_helpers import free_ports

GREEDY = dict(temperature=0.0, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_node1(model: str, addr: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "nanovllm.cli", "worker", model, "--nnodes", "2",
                             "--node-rank", "1", "--dist-init-addr", addr, "--log-level", "warning", *extra],
                            env=env, stderr=subprocess.PIPE, text=True)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def shm_mappings(pid: int) -> list[str]:
    """The /dev/shm files a process has mapped (a shared-memory channel would be one)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line.split()[-1] for line in f if "/dev/shm/" in line]
    except OSError:
        return []


def pid_exists(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its reaper does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still running after up to timeout_s (a resource tracker leaves just after its parent)."""
    deadline = time.monotonic() + timeout_s
    while any(pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [(pid, process_name(pid)) for pid in pids if pid_exists(pid)]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return [o["token_ids"] for o in out]


ENGINE = dict(dtype="float32", kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = [list(range(40, 80)), list(range(3, 15)), [7, 8, 9]]  # the first is prefilled in two chunks


def test_two_nodes_match_tp1_over_a_broadcast_and_exit_together(qwen3_gqa):
    with LLM(qwen3_gqa, **ENGINE) as llm:
        expected = generate(llm, PROMPTS, 12)
    addr = f"127.0.0.1:{free_ports(1)}"
    node1 = start_node1(qwen3_gqa, addr)
    try:
        llm = LLM(qwen3_gqa, tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=addr,
                  dist_timeout_s=120, **ENGINE)
        try:
            assert isinstance(llm.llm_engine.model_runner.pool.channel, BroadcastChannel)
            assert llm.llm_engine.model_runner.pool.workers == []  # node 0's only rank is this process
            steps, schedule = [], llm.llm_engine.scheduler.schedule

            def spy():
                out = schedule()
                steps.append([(s.num_computed_tokens, n, len(s)) for s, n in zip(out.seqs, out.num_new_tokens)])
                return out
            llm.llm_engine.scheduler.schedule = spy
            got = generate(llm, PROMPTS, 12)
            node1_pids = descendants(node1.pid)
            assert len(node1_pids) >= 1  # rank 1 (spawn may add its resource tracker)
            for pid in [os.getpid(), node1.pid, *node1_pids]:
                assert not [m for m in shm_mappings(pid) if "nanovllm" in m], pid
        finally:
            llm.exit()
        assert node1.wait(timeout=60) == 0, node1.stderr.read()[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert got == expected
    assert any(computed + n < length for step in steps for computed, n, length in step)  # a chunked prefill
    assert wait_gone(node1_pids) == []
    assert mp.active_children() == []
    assert not torch.distributed.is_initialized()


def test_a_rank_dying_on_another_node_is_named(qwen3_gqa):
    addr = f"127.0.0.1:{free_ports(1)}"
    node1 = start_node1(qwen3_gqa, addr)
    try:
        with pytest.raises(RuntimeError) as failure:
            with LLM(qwen3_gqa, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, dist_timeout_s=120,
                     **ENGINE) as llm:
                generate(llm, PROMPTS[1:], 2)
                [rank1] = [pid for pid in descendants(node1.pid) if "spawn_main" in process_name(pid)]
                os.kill(rank1, signal.SIGKILL)
                started = time.monotonic()
                generate(llm, PROMPTS, 40)
        assert time.monotonic() - started < 30  # the closed connection, not dist_timeout_s
        message = str(failure.value)
        assert "nanovllm-tp-rank1" in message and "exit code -9" in message and "on node 1" in message, message
        assert node1.wait(timeout=30) == 1
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert mp.active_children() == []
    assert not torch.distributed.is_initialized()


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# ---- options and the rendezvous ------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234"), r"node_rank .*\[0, 2\)"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=-1, dist_init_addr="127.0.0.1:1234"), "node_rank"),
    (dict(tensor_parallel_size=2, nnodes=4, dist_init_addr="127.0.0.1:1234"), r"divisible by nnodes \(4\)"),
    (dict(tensor_parallel_size=2, nnodes=0, dist_init_addr="127.0.0.1:1234"), "nnodes must be >= 1"),
    (dict(tensor_parallel_size=2, nnodes=2), "dist_init_addr .* is required"),
    (dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="127.0.0.1"), "dist_init_addr must be 'HOST:PORT'"),
    (dict(tensor_parallel_size=2, nnodes=2, dist_init_addr=":1234"), "dist_init_addr must be 'HOST:PORT'"),
    (dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="host:70000"), "dist_init_addr must be 'HOST:PORT'"),
    (dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="host:12ab"), "dist_init_addr must be 'HOST:PORT'"),
    (dict(tensor_parallel_size=2, dist_init_addr="127.0.0.1:1234", dist_port=1234), "not both"),
])
def test_node_options_are_validated(qwen3_gqa, options, match):
    with pytest.raises(ValueError, match=match):
        Config(qwen3_gqa, **options)


def test_ipv6_address_and_the_engine_only_on_node_0(qwen3_gqa):
    assert Config(qwen3_gqa, tensor_parallel_size=2, nnodes=2, dist_init_addr="[::1]:29500").nnodes == 2
    with pytest.raises(ValueError, match="node_rank 1: the engine runs on node 0"):
        LLM(qwen3_gqa, tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="node_rank 0 runs the engine"):
        run_node(qwen3_gqa, 2, 0, "127.0.0.1:1234")


def test_worker_command_reports_bad_options_in_one_line(qwen3_gqa, capsys):
    argv = ["worker", qwen3_gqa, "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1234"]
    assert cli_main(argv) == 2
    assert "nanovllm worker: error: node_rank must be in [0, nnodes) = [0, 2), got 2" in capsys.readouterr().err
    assert cli_main(argv[:5] + ["1", "--dist-init-addr", "nowhere"]) == 2
    assert "dist_init_addr must be 'HOST:PORT'" in capsys.readouterr().err


def test_unreachable_rendezvous_times_out_naming_the_address(qwen3_gqa):
    addr = f"127.0.0.1:{free_ports(1)}"  # nobody listens there
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"cannot reach the rendezvous at {addr} .* within 1.0s"):
        run_node(qwen3_gqa, 2, 1, addr, timeout_s=1.0)
    assert time.monotonic() - started < 10  # torch retries the connection once


def test_serve_with_a_node_rank_runs_the_worker(qwen3_gqa, capsys):
    addr = f"127.0.0.1:{free_ports(1)}"
    argv = ["serve", qwen3_gqa, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
            "--dist-timeout-s", "1"]
    assert cli_main(argv) == 1  # node 0 unreachable: not a usage mistake
    assert f"nanovllm serve: error: cannot reach the rendezvous at {addr}" in capsys.readouterr().err


def test_node_0_alone_times_out_naming_the_address(qwen3_gqa):
    addr = f"127.0.0.1:{free_ports(1)}"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"not every node joined the rendezvous at {addr}"):
        LLM(qwen3_gqa, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, dist_timeout_s=2.0, **ENGINE)
    assert time.monotonic() - started < 15
    assert mp.active_children() == []
    assert not torch.distributed.is_initialized()
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", int(addr.rsplit(":", 1)[1])))
    # The failed start leaves nothing that stops the next engine of this process from starting.
    with LLM(qwen3_gqa, tensor_parallel_size=2, dist_timeout_s=60, **ENGINE) as llm:
        assert len(generate(llm, [[5, 6, 7]], 2)[0]) == 2


def test_node_1_ends_its_ranks_when_rank_0_is_killed(qwen3_gqa, tmp_path):
    addr = f"127.0.0.1:{free_ports(1)}"
    script = tmp_path / "node0.py"
    script.write_text(
        "import sys, time\n"
        "from nanovllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({qwen3_gqa!r}, tensor_parallel_size=2, nnodes=2, dist_init_addr={addr!r}, dtype='float32')\n"
        "    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n")
    node1 = start_node1(qwen3_gqa, addr)
    node0 = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=ROOT),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert node0.stdout.readline().strip() == "ready"
        node1_pids = descendants(node1.pid)
        node0.kill()  # no exit call: rank 1 sees its connections to rank 0 close
        assert node1.wait(timeout=60) == 0, node1.stderr.read()[-2000:]
        assert wait_gone(node1_pids) == []
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_cuda_ranks_of_a_node_count_its_own_gpus(qwen3_gqa, monkeypatch):
    """On CUDA each node needs a GPU per rank of its own (not per rank of the engine), and node k's
    consecutive ranks land on distinct local GPUs."""
    from nanovllm.platforms.cuda import CudaPlatform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="exceeds the 1 visible CUDA"):
        Config(qwen3_gqa, device="cuda", tensor_parallel_size=2)
    assert Config(qwen3_gqa, device="cuda", tensor_parallel_size=2, nnodes=2, node_rank=1,
                  dist_init_addr="10.0.0.1:29500").node_rank == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [CudaPlatform().device_of_rank(r).index for r in range(4)] == [0, 1, 0, 1]  # 2 nodes x 2 GPUs
