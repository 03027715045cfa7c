"""Replicas behind sglang-router: `nanovllm serve --data-parallel-size 2` under an outside router
answers like the offline engine (streams too), survives a replica's death, and leaves no process
behind; SGLang's probe routes and the request fields the router adds; the supervisor's pieces.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.cli import build_parser, main  # noqa: E402
from nanovllm.entrypoints import replicas  # noqa: E402
from nanovllm.platforms import CudaPlatform  # noqa: E402

from server_fixtures import ENGINE_OPTIONS, MODEL, client, ref_llm, served  # noqa: E402,F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
IS_LINUX = sys.platform.startswith("linux")
ENGINE_FLAGS = ["--kvcache-block-size", str(ENGINE_OPTIONS["kvcache_block_size"]),
                "--max-model-len", str(ENGINE_OPTIONS["max_model_len"]),
                "--cpu-kvcache-bytes", str(ENGINE_OPTIONS["cpu_kvcache_bytes"])]
PROMPTS = ["the quick brown fox", "seven bright stars shine", "old quiet rivers and small", "people talk near"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# The bodies sglang-router 0.3.2 sends for a plain client request (logged from a worker): it adds
# every one of these fields itself.
ROUTER_COMPLETION = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.0, "stream": False,
                     "echo": False, "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True,
                     "return_hidden_states": False}
ROUTER_CHAT = {"messages": [{"role": "user", "content": "the quick brown fox"}], "logprobs": False,
               "max_completion_tokens": 8, "stream": False, "temperature": 0.0, "no_stop_trim": False,
               "ignore_eos": True, "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}


# ---- SGLang's probe routes and request fields (one in-process server) ---------------------------
def test_probe_routes_answer_sglangs_fields(served, qwen3_gqa):
    url = served[1]
    info = httpx.get(url + "/model_info").json()
    assert info == httpx.get(url + "/get_model_info").json()
    assert info["model_path"] == info["tokenizer_path"] == qwen3_gqa
    assert info["is_generation"] is True and info["served_model_name"] == MODEL
    server = httpx.get(url + "/server_info").json()
    assert server == httpx.get(url + "/get_server_info").json()
    assert {k: server[k] for k in info} == info
    assert (server["context_length"], server["page_size"], server["dp_size"], server["tp_size"]) == (256, 16, 1, 1)
    assert server["max_total_num_tokens"] == ENGINE_OPTIONS["cpu_kvcache_bytes"] // 16384 * 16
    assert server["version"] == httpx.get(url + "/version").json()["version"]


def test_fields_the_router_adds_are_accepted(served, ref_llm):
    ref = ref_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]["text"]
    out = httpx.post(served[1] + "/v1/completions", json={"model": MODEL, **ROUTER_COMPLETION}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == ref
    chat_ref = ref_llm.chat([ROUTER_CHAT["messages"]], GREEDY, use_tqdm=False)[0]["text"]
    out = httpx.post(served[1] + "/v1/chat/completions", json={"model": MODEL, **ROUTER_CHAT}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["content"] == chat_ref
    # Both values of the reasoning fields leave the text whole (no reasoning parser, as in SGLang without one).
    flipped = {**ROUTER_CHAT, "separate_reasoning": False, "stream_reasoning": False}
    out = httpx.post(served[1] + "/v1/chat/completions", json={"model": MODEL, **flipped}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["content"] == chat_ref


@pytest.mark.parametrize("route, body, named", [
    ("/v1/completions", {**ROUTER_COMPLETION, "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/chat/completions", {**ROUTER_CHAT, "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/chat/completions", {**ROUTER_CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/v1/completions", {**ROUTER_COMPLETION, "no_stop_trim": True, "include_stop_str_in_output": False},
     "no_stop_trim"),
    # Still unknown: fields the router adds only to chat, SGLang's other fields, anything else.
    ("/v1/completions", {**ROUTER_COMPLETION, "separate_reasoning": True}, "separate_reasoning"),
    ("/v1/completions", {**ROUTER_COMPLETION, "regex": "a+"}, "regex"),
    ("/v1/chat/completions", {**ROUTER_CHAT, "lora_path": "x"}, "lora_path"),
])
def test_unsupported_sglang_values_are_400_naming_the_field(served, route, body, named):
    out = httpx.post(served[1] + route, json={"model": MODEL, **body}, timeout=60)
    assert out.status_code == 400 and named in out.json()["error"]["message"]


def test_no_stop_trim_keeps_the_stop_string(client, ref_llm):
    words = ref_llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]["text"].split(" ")
    stop = words[2]
    ref = ref_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop,
                                                        include_stop_str_in_output=True), use_tqdm=False)[0]
    assert ref["text"].endswith(stop)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True, "no_stop_trim": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (ref["text"], "stop")


# ---- the supervisor's pieces --------------------------------------------------------------------
def test_replica_command_keeps_every_option_but_the_supervisors():
    argv = ["serve", "/m", "-dp", "3", "--port", "9000", "--router", "--router-port", "9100", "--enforce-eager",
            "--no-enable-prefix-caching", "--max-model-len", "256", "--api-key", "k", "--log-level", "warning"]
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


# ---- two replicas behind sglang-router (processes) ----------------------------------------------
def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text() if IS_LINUX else None
    except OSError:
        return False
    if stat is None:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except OSError:
            continue
    return found


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count <= 65535 and all(replicas_check_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports")


def replicas_check_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Replicas:
    """`nanovllm serve --data-parallel-size 2` as a user starts it, and its replica processes."""

    def __init__(self, model: str, log_dir: Path):
        base = free_ports(2)
        self.urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
        self.out, self.err = log_dir / "dp.out", log_dir / "dp.err"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.parent = subprocess.Popen(
                [sys.executable, "-m", "nanovllm.cli", "serve", model, "--data-parallel-size", "2",
                 "--port", str(base), "--served-model-name", MODEL, "--log-level", "warning", *ENGINE_FLAGS],
                cwd=REPO, env=env, stdout=out, stderr=err)
        ready = wait_until(lambda: "replicas ready" in self.out.read_text() or self.parent.poll() is not None, 240)
        assert ready and self.parent.poll() is None, f"supervisor did not start: {self.err.read_text()[-3000:]}"
        self.pids = sorted(children_of(self.parent.pid)) if IS_LINUX else []

    def stop(self) -> None:
        for pid in [self.parent.pid] + self.pids:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.parent.wait()


@pytest.fixture(scope="module")
def dp(qwen3_gqa, tmp_path_factory):
    group = Replicas(qwen3_gqa, tmp_path_factory.mktemp("dp"))
    yield group
    group.stop()  # a no-op once test_sigterm_ends_every_process passed


@pytest.fixture(scope="module")
def router(dp, tmp_path_factory):
    """sglang-router in front of the replicas: round robin, retries on (its default), quick health checks."""
    pytest.importorskip("sglang_router")
    port = free_ports(1)
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *dp.urls, "--policy", "round_robin", "--log-level", "warn",
             "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1"],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def both_registered() -> bool:
        try:
            return len(httpx.get(url + "/workers", timeout=2).json()["workers"]) == 2
        except (httpx.HTTPError, ValueError, KeyError):
            return process.poll() is not None
    assert wait_until(both_registered, 60) and process.poll() is None, log.read_text()[-3000:]
    yield process, url
    if process.poll() is None:
        process.kill()
        process.wait()


def router_client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_answers(client_, ref_llm, prompts) -> None:
    """Completions and chat, whole and streamed, equal the local engine's greedy text."""
    refs = [r["text"] for r in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    chat_refs = [r["text"] for r in ref_llm.chat(conversations, GREEDY, use_tqdm=False)]
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    for prompt, ref, messages, chat_ref in zip(prompts, refs, conversations, chat_refs):
        assert client_.completions.create(prompt=prompt, **kwargs).choices[0].text == ref
        streamed = client_.completions.create(prompt=prompt, stream=True, **kwargs)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref
        assert client_.chat.completions.create(messages=messages, **kwargs).choices[0].message.content == chat_ref
        streamed = client_.chat.completions.create(messages=messages, stream=True, **kwargs)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat_ref


def test_each_replica_answers_like_the_local_engine(dp, ref_llm):
    assert len(dp.pids) == 2 or not IS_LINUX
    for url in dp.urls:
        check_answers(router_client(url), ref_llm, PROMPTS[:1])


def test_router_answers_like_the_local_engine(dp, router, ref_llm):
    check_answers(router_client(router[1]), ref_llm, PROMPTS)  # round robin: both replicas answer


@pytest.mark.skipif(not IS_LINUX, reason="finds the replicas' pids in /proc")
def test_a_dead_replica_is_logged_and_the_others_keep_serving(dp, ref_llm, request):
    os.kill(dp.pids[0], signal.SIGKILL)
    assert wait_until(lambda: "exited with status -9; 1 of 2 replicas still serving" in dp.err.read_text(), 10)
    assert dp.parent.poll() is None and is_alive(dp.pids[1])
    check_answers(router_client(dp.urls[1]), ref_llm, PROMPTS[:1])
    if importlib_util_find("sglang_router"):
        client_ = router_client(request.getfixturevalue("router")[1])
        for _ in range(2):  # round robin reaches the dead one: the router retries on the live one
            check_answers(client_, ref_llm, PROMPTS[:2])


def test_sigterm_ends_every_process(dp, request):
    dp.parent.send_signal(signal.SIGTERM)
    assert dp.parent.wait(30) == 0
    assert not [pid for pid in dp.pids if is_alive(pid)]
    if importlib_util_find("sglang_router"):
        process, _ = request.getfixturevalue("router")
        process.terminate()
        assert process.wait(30) is not None
    leftovers = [pid for pid in children_of(os.getpid()) if is_alive(pid)] if IS_LINUX else []
    assert not leftovers, f"processes left: {leftovers}"


def importlib_util_find(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None
