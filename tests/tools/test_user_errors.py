"""What a new user trips over: each mistake in example.py, bench.py and `nanovllm serve` ends in one
stderr line naming it and exit status 2; hub ids get a hint; help texts say what flags do and default to."""
import importlib.util
import json
import logging
import os
import shutil
import socket
import sys

import pytest

from nanovllm import LLM
from nanovllm.cli import build_parser, check_port
from nanovllm.loader.checkpoint import Checkpoint
from cli_helpers import REPO, cache_with_built_kernels, one_error_line, run  # noqa: E402


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), REPO / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def weights_only(qwen3_gqa, tmp_path_factory) -> str:
    """The tiny checkpoint without its tokenizer files, like bench.py's random checkpoint."""
    path = tmp_path_factory.mktemp("weights_only")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(qwen3_gqa, name), path)
    return str(path)


# ---- example.py ---------------------------------------------------------------------------------
def test_example_missing_model_folder(tmp_path):
    line = one_error_line(run("example.py", "--model", str(tmp_path / "nope"), cache=tmp_path))
    assert line.startswith("example.py: error:") and str(tmp_path / "nope") in line and "does not exist" in line


def test_example_max_tokens_zero_fails_before_the_default_model(tmp_path):
    line = one_error_line(run("example.py", "--max-tokens", "0", cache=tmp_path))
    assert "--max-tokens" in line and "got 0" in line
    assert list(tmp_path.iterdir()) == []  # nothing downloaded


def test_example_folder_without_chat_template(weights_only, tmp_path):
    proc = run("example.py", "--model", weights_only, "--max-tokens", "2", cache=cache_with_built_kernels(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]  # the engine's INFO start-up lines come first
    assert last.startswith("example.py: error:") and weights_only in last and "chat template" in last
    assert "Traceback" not in proc.stderr


def test_example_help_says_what_each_dtype_does(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["example.py", "--help"])
    with pytest.raises(SystemExit):
        load_script("example.py").parse_args()
    text = " ".join(capsys.readouterr().out.split())
    for words in ("float16", "float32", "bfloat16", "not fast", "bf16 weights under float32 activations",
                  "(default: 64)"):
        assert words in text, words


# ---- bench.py -----------------------------------------------------------------------------------
def test_bench_bad_flag_value(tmp_path):
    line = one_error_line(run("bench.py", "--num-seqs", "0", cache=tmp_path))
    assert line.startswith("bench.py: error:") and "--num-seqs" in line and "got 0" in line
    assert list(tmp_path.iterdir()) == []  # the random checkpoint was not built


@pytest.mark.parametrize("argv,words", [
    (["--min-input-len", "300", "--max-input-len", "200"], ["--min-input-len (300)", "--max-input-len (200)"]),
    (["--max-input-len", "4000", "--max-output-len", "200"], ["4000 + 200", "--max-model-len (4096)"]),
    (["--json", "/no/such/folder/out.json"], ["--json", "folder does not exist"]),
    (["--hf-batch-size", "x"], ["--hf-batch-size", "'x'"]),
])
def test_bench_flags_checked_before_any_checkpoint(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        load_script("bench.py").parse_args()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def test_bench_engine_errors_are_one_line(weights_only, tmp_path, capsys, monkeypatch):
    bench = load_script("bench.py")
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", str(tmp_path / "nope")])
    assert bench.main() == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"bench.py: error: model folder '{tmp_path / 'nope'}' does not exist or is not a directory"]
    # The tiny model has 512 positions: a workload longer than that is named before any request runs.
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", weights_only, "--max-input-len", "400",
                                      "--max-output-len", "200"])
    assert bench.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(600)" in err[0] and "max_model_len (512)" in err[0], err


def test_bench_runs_on_a_weights_only_folder_without_warnings(weights_only, tmp_path, caplog, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", weights_only, "--num-seqs", "3", "--min-input-len",
                                      "4", "--max-input-len", "8", "--min-output-len", "2", "--max-output-len", "4",
                                      "--max-num-seqs", "4", "--json", str(out)])
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        assert load_script("bench.py").main() == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("no tokenizer files" in r.getMessage() for r in caplog.records)  # said, at INFO
    results = json.loads(out.read_text())
    assert results["num_seqs"] == 3 and 3 * 2 <= results["output_tokens"] <= 3 * 4


def test_bench_and_example_take_a_speculative_config(weights_only, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench.json"
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", weights_only, "--num-seqs", "2", "--min-input-len",
                                      "4", "--max-input-len", "8", "--min-output-len", "24", "--max-output-len", "24",
                                      "--max-num-seqs", "2", "--speculative-config", ngram, "--json", str(out)])
    assert load_script("bench.py").main() == 0
    assert "speculation: " in capsys.readouterr().out
    spec = json.loads(out.read_text())["speculation"]
    assert spec["num_emitted_tokens"] == spec["num_accepted_tokens"] + spec["num_drafts"]
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", weights_only, "--speculative-config", bad])
    assert load_script("bench.py").main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench.py: error: speculative_config.num_speculative_tokens must be in [1, 16], got 0"]
    line = one_error_line(run("example.py", "--model", weights_only, "--speculative-config", "[1]", cache=tmp_path))
    assert line.startswith("example.py: error: argument --speculative-config: must be a JSON object")


# The device-dependent workload defaults, as docs/benchmarks.md states them: (CUDA, CPU).
DEVICE_DEFAULTS = {"--num-seqs": (256, 64), "--min-input-len": (100, 32), "--max-input-len": (1024, 256),
                   "--min-output-len": (100, 32), "--max-output-len": (1024, 256), "--max-num-seqs": (256, 64)}


def test_bench_help_covers_every_flag_and_its_default():
    import torch
    actions = [a for a in load_script("bench.py").build_parser()._actions if a.dest != "help"]
    assert len(actions) >= 16  # the issue counted 16
    for action in actions:
        flag = action.option_strings[0]
        assert action.help, flag
        if flag in DEVICE_DEFAULTS:
            cuda, cpu = DEVICE_DEFAULTS[flag]
            assert f"(default: {cuda} on CUDA, {cpu} on CPU)" in action.help, flag
            assert action.default == (cuda if torch.cuda.is_available() else cpu), flag
        elif action.default not in (None, False):  # store_true flags and optional paths have none to show
            assert "default" in action.help, flag


def test_bench_help_renders_the_defaults(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--help"])
    with pytest.raises(SystemExit):
        load_script("bench.py").parse_args()
    text = " ".join(capsys.readouterr().out.split())
    for words in ("(default: 256 on CUDA, 64 on CPU)", "longest prompt + output (default: 4096)",
                  "transformers batch (default: 16)", "auto (default): CUDA if available"):
        assert words in text, words


# ---- nanovllm serve -------------------------------------------------------------------------------
def test_serve_missing_model_folder(tmp_path):
    line = one_error_line(run("-m", "nanovllm.cli", "serve", str(tmp_path / "nope"), "--port", "0",
                              cache=tmp_path))
    assert line.startswith("nanovllm serve: error:") and "does not exist" in line


def test_serve_taken_port_fails_before_the_model_loads(qwen3_gqa, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # One line means no engine start-up log came before it: the model was never loaded.
        line = one_error_line(run("-m", "nanovllm.cli", "serve", qwen3_gqa, "--port", str(port), cache=tmp_path))
    assert f"port {port}" in line and "already in use" in line and "--port" in line


# Flag values that need no model, each refused before the model is looked for, fetched or loaded
# (a bad --kv-cache-dtype used to come after the default model's download and load).
@pytest.mark.parametrize("flags, words", [
    (["--kv-cache-dtype", "int4"], "kv_cache_dtype must be one of"),
    (["--dtype", "float8"], "dtype must be 'auto' or one of"),
    (["--device", "tpu"], "device must be one of"),
    (["--quantization", "q3_x"], "quantization 'q3_x' is not supported"),
    (["--attention-backend", "magic"], "attention_backend must be one of"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
    (["--kvcache-block-size", "20"], "kvcache_block_size must be a multiple of 16, got 20"),
    (["--cpu-input-bits", "4"], "cpu_input_bits must be 'auto', 8 or 14, got 4"),
    (["--runner", "train"], "runner must be"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["--generation-config", "/no/such/folder"], "is not a folder holding a generation_config.json"),
    (["--override-generation-config", '{"temprature": 0}'], "unknown key(s) ['temprature']"),
    (["--override-generation-config", '{"max_new_tokens": 0}'], "max_tokens must be >= 1"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
    (["--nnodes", "2", "-tp", "2"], "dist_init_addr"),
])
def test_serve_checks_every_flag_before_any_model_work(flags, words, capsys, monkeypatch):
    from nanovllm import cli

    def no_model_work(*args, **kwargs):
        raise AssertionError("the model was looked for before the flags were checked")
    monkeypatch.setattr(cli, "model_path", no_model_work)
    monkeypatch.setattr("nanovllm.LLM", no_model_work)
    for argv in (["serve", *flags], ["serve", "some/folder", *flags], ["serve", *flags, "-dp", "2"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("nanovllm serve: error:") and words in err[0], (argv, err)


def test_example_and_bench_check_engine_flags_before_the_model(tmp_path, capsys, monkeypatch):
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    line = one_error_line(run("example.py", "--speculative-config", bad, cache=tmp_path))
    assert line == "example.py: error: speculative_config.num_speculative_tokens must be in [1, 16], got 0"
    assert list(tmp_path.iterdir()) == []  # the default model was not fetched
    bench = load_script("bench.py")

    def no_checkpoint():
        raise AssertionError("the random checkpoint was written before the flags were checked")
    monkeypatch.setattr(bench, "random_qwen3_checkpoint", no_checkpoint)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--speculative-config", bad])
    assert bench.main() == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "bench.py: error: speculative_config.num_speculative_tokens must be in [1, 16], got 0"]


def test_example_names_the_first_runs_one_time_work(monkeypatch):
    example = load_script("example.py")
    assert example.load_times(0.01, 0.0, 2.04) == "load 2.0 s"
    assert example.load_times(20.0, 11.5, 33.1) == \
        "load 1.6 s (+ once: fetching the model 20.0 s, compiling the C kernels 11.5 s)"


def test_check_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "already in use" in check_port("127.0.0.1", port)
    assert check_port("127.0.0.1", port) is None  # closed again: free
    assert check_port("127.0.0.1", 0) is None
    assert check_port("127.0.0.1", 70000) == "--port must be in 0..65535, got 70000"
    assert "--host 'no-such-host.invalid'" in check_port("no-such-host.invalid", 8000)


def test_serve_help_shows_the_defaults():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "TCP port to listen on (default: 8000)" in text
    assert "(default: 127.0.0.1, loopback only" in text and "(default: info)" in text


# ---- library messages ---------------------------------------------------------------------------
def test_hub_id_gets_a_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "Qwen/Qwen3-0.6B" is not a folder here
    with pytest.raises(ValueError) as e:
        LLM("Qwen/Qwen3-0.6B")
    message = str(e.value)
    assert "'Qwen/Qwen3-0.6B' does not exist" in message and "hub id" in message
    assert "does not download" in message and "snapshot_download('Qwen/Qwen3-0.6B')" in message
    assert "LLM.default()" in message


@pytest.mark.parametrize("model", ["/abs/missing", "./Qwen3", "a/b/c", "../Qwen3", "owner/", "my model/x"])
def test_paths_get_no_hub_hint(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not exist") as e:
        LLM(model)
    assert "hub" not in str(e.value)


def test_existing_owner_name_folder_is_read_as_a_folder(tmp_path, monkeypatch):
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="has no config.json"):
        LLM("Qwen/Qwen3-0.6B")


def test_weights_only_folder_is_info_not_warning(weights_only, caplog):
    with caplog.at_level(logging.DEBUG, logger="nanovllm"):
        assert Checkpoint(weights_only).load_tokenizer() is None
    [record] = [r for r in caplog.records if "no tokenizer files" in r.getMessage()]
    assert record.levelno == logging.INFO
