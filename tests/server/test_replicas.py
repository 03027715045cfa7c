"""The data-parallel supervisor's pieces (entrypoints/replicas.py, cli.py): a replica's command, its
ports, cores and GPUs, the user errors caught before anything starts, children dying with the parent.
The replicas themselves, behind sglang-router, are tests/server/test_router.py."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.cli import build_parser, main
from nanovllm.entrypoints import replicas
from nanovllm.platforms import CudaPlatform

from process_helpers import IS_LINUX, free_ports, is_alive, port_is_free, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_replica_command_keeps_every_option_but_the_supervisors():
    argv = ["serve", "/m", "-dp", "3", "--port", "9000", "--router", "--router-port", "9100", "--enforce-eager",
            "--no-enable-prefix-caching", "--max-model-len", "256", "--api-key", "k", "--log-level", "warning",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--reasoning-parser", "qwen3",
            "--generation-config", "vllm"]
    args = build_parser().parse_args(argv)
    command = replicas.replica_argv(args.serve_parser, args, 9002)
    assert command[:4] == [sys.executable, "-m", "nanovllm.cli", "serve"]
    again = build_parser().parse_args(command[3:])  # the replica's own parse of it
    expected = {**vars(args), "port": 9002, "data_parallel_size": 1, "router": False, "router_port": 30000}
    assert {k: v for k, v in vars(again).items() if k != "serve_parser"} == \
        {k: v for k, v in expected.items() if k != "serve_parser"}


def test_replica_ports_and_urls():
    args = build_parser().parse_args(["serve", "-dp", "3", "--port", "9000"])
    assert replicas.replica_ports(args) == [9000, 9001, 9002]
    args = build_parser().parse_args(["serve", "-dp", "2", "--data-parallel-base-port", "65535"])
    with pytest.raises(ValueError, match="--data-parallel-base-port 65535"):
        replicas.replica_ports(args)
    assert replicas.local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert replicas.local_url("::", 8000) == "http://[::1]:8000"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_cpu_shares_split_the_cores():
    cores = sorted(os.sched_getaffinity(0))
    for n in range(1, len(cores) + 1):
        shares = [replicas.cpu_share(i, n) for i in range(n)]
        assert all(len(s) == len(cores) // n for s in shares)
        flat = [c for s in shares for c in s]
        assert len(set(flat)) == len(flat) and set(flat) <= set(cores)  # disjoint
    assert replicas.cpu_share(len(cores), len(cores) + 1) == [cores[0]]  # more replicas than cores: shared


def test_cuda_replicas_get_their_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9")
    cuda = CudaPlatform()
    assert [cuda.replica_env(i, 2, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "3,5"},
                                                             {"CUDA_VISIBLE_DEVICES": "7,9"}]
    assert [cuda.replica_env(i, 4, 1)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["3", "5", "7", "9"]
    with pytest.raises(ValueError, match="needs 6 GPUs, but 4 are visible"):
        cuda.replica_env(0, 3, 2)


def test_serve_dp_user_errors(qwen3_gqa, capsys):
    base = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        assert main(["serve", qwen3_gqa, "-dp", "2", "--port", str(base)]) == 2  # before any model load
        assert f"port {base + 1} on 127.0.0.1 is already in use" in capsys.readouterr().err
    serve = ["serve", qwen3_gqa, "-dp", "2", "--port", str(base)]
    assert main([*serve, "--router", "--router-port", str(base + 1)]) == 2
    assert f"--router-port {base + 1} is one of the replica ports" in capsys.readouterr().err
    assert main([*serve, "--max-model-len", "0"]) == 2
    assert "max_model_len must be" in capsys.readouterr().err
    assert main(["serve", qwen3_gqa, "--data-parallel-base-port", str(base)]) == 2
    assert "needs --data-parallel-size > 1" in capsys.readouterr().err


@pytest.mark.skipif(not IS_LINUX, reason="parent-death signal is Linux's")
def test_children_die_with_the_parent_even_by_sigkill(tmp_path):
    parent_code = ("import sys, time; from nanovllm.entrypoints import replicas; "
                   "c = replicas.spawn('child', 'x', [sys.executable, '-c', 'import time; time.sleep(60)']); "
                   "print(c.process.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert is_alive(child)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not is_alive(child), 10), "the child outlived its parent"
    finally:
        if is_alive(child):
            os.kill(child, signal.SIGKILL)


def test_each_replica_gets_its_port_cores_threads_and_kv_share(qwen3_gqa, monkeypatch):
    from nanovllm.config import Config
    from nanovllm.platforms import CpuPlatform

    started = []
    monkeypatch.setattr(replicas, "spawn", lambda name, url, argv, env, cores: started.append((url, argv, env, cores)))
    args = build_parser().parse_args(["serve", qwen3_gqa, "-dp", "2", "--port", "9000", "--device", "cpu"])
    config = Config(qwen3_gqa, device="cpu")
    replicas.start_replicas(args.serve_parser, args, qwen3_gqa, config, [{"X": "0"}, {"X": "1"}], [])
    assert [url for url, *_ in started] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    whole = CpuPlatform().default_kvcache_bytes(1)
    for i, (_, argv, env, cores) in enumerate(started):
        parsed = build_parser().parse_args(argv[3:])
        assert (parsed.model, parsed.port, parsed.device, parsed.data_parallel_size) == (qwen3_gqa, 9000 + i, "cpu", 1)
        assert abs(2 * parsed.cpu_kvcache_bytes - whole) < 0.05 * whole  # half of one engine's default each
        assert env["X"] == str(i) and env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
        assert cores == replicas.cpu_share(i, 2) and env["OMP_NUM_THREADS"] == str(len(cores or [0]))


def test_a_replica_that_fails_to_start_stops_the_others(qwen3_gqa):
    base = free_ports(2)
    run = subprocess.run([sys.executable, "-m", "nanovllm.cli", "serve", qwen3_gqa, "-dp", "2", "--port", str(base),
                          "--cpu-kvcache-bytes", "1", "--log-level", "warning"],  # no KV block fits: each exits 2
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 1
    assert "exited with status 2 before it was ready; stopping the others" in run.stderr
    assert "not even one KV cache block" in run.stderr  # the replica's own one-line error
    assert all(port_is_free(base + i) for i in range(2))
