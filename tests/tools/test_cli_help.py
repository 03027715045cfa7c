"""`nanovllm serve --help` and flag mistakes as a new user meets them: every engine option states
its default (Config's own, or the platform's rule), `-tp` is `--tensor-parallel-size`, and an
unknown flag is refused by the command that was given, in one line (`nanovllm serve: error:`)."""
import dataclasses
import re

import pytest

from nanovllm.cli import _ENGINE_OPTIONS, build_parser
from nanovllm.config import Config

from cli_helpers import one_error_line, run


def serve_help() -> str:
    return build_parser().command_parsers["serve"].format_help()


def test_every_engine_option_states_its_default():
    text = " ".join(serve_help().split())  # argparse wraps the help lines
    text = text[text.index("engine options:"):]  # past the usage line, which names every flag too
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for flag, dest, _, _ in _ENGINE_OPTIONS:
        block = text[text.index(flag + " "):]
        stated = re.search(r"\(default: ([^)]*)\)", block).group(1)
        if defaults[dest] is None:  # decided by the platform: said in words
            assert stated and stated != "None", flag
        else:
            assert stated == str(defaults[dest]), (flag, stated, defaults[dest])
    assert "(default: 16 on CPU, 256 on CUDA)" in text
    assert "number of GPUs" not in text and "processes sharing the cores on CPU" in text


def test_tp_alias():
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "-tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["serve", "m", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2


@pytest.mark.parametrize("argv, prefix", [
    (["serve", "m", "--temprature", "1"], "nanovllm serve: error: unrecognized arguments: --temprature 1"),
    (["worker", "m", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:1", "--zz"],
     "nanovllm worker: error: unrecognized arguments: --zz"),
])
def test_unknown_flags_are_refused_by_their_command(argv, prefix, tmp_path):
    line = one_error_line(run("-m", "nanovllm.cli", *argv, cache=tmp_path))
    assert line.startswith(prefix) and line.endswith("(see --help)")


def test_start_up_says_what_a_user_wants_to_know(qwen3_gqa, caplog):
    """One INFO line: the model, device and dtypes, the KV capacity in tokens (blocks x block size,
    hand count) and its memory, the process's peak RSS; the C decode's internals only at DEBUG."""
    import logging

    from nanovllm import LLM
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(qwen3_gqa, dtype="bfloat16", kvcache_block_size=16, max_model_len=64,
                 cpu_kvcache_bytes=1 << 22) as llm:
            blocks = llm.llm_engine.num_kvcache_blocks
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    summary = [line for line in lines if line.startswith("model ")]
    assert len(summary) == 1, lines
    assert summary[0].startswith(f"model {qwen3_gqa.rstrip('/').rsplit('/', 1)[-1]} (Qwen3ForCausalLM) on cpu, "
                                 "float32 activations, bfloat16 weights; ")
    # kv_cache_dtype auto on a CPU: float16; 2 layers x (K, V) x 2 KV heads x 32 dims x 2 bytes per token
    token_bytes = 2 * 2 * 2 * 32 * 2
    assert blocks == (1 << 22) // (16 * token_bytes)
    assert (f"KV cache {blocks * 16} tokens in float16, {token_bytes} bytes per token ({blocks} blocks of 16), "
            f"{blocks * 16 * token_bytes / 2**20:.0f} MiB per rank reserved, pages touched as used; "
            "cpu_kvcache_bytes (--cpu-kvcache-bytes) bounds it; ") in summary[0]
    assert re.search(r"peak RSS \d+ MiB$", summary[0])
    assert re.search(r"bfloat16 weights; weights \d+ MiB held per rank; KV cache", summary[0])
    assert not any("decode steps in C" in line for line in lines)


def test_start_up_says_where_sampled_defaults_come_from(qwen3_gqa, tmp_path, caplog):
    """A model card's sampled defaults make the same question come back differently: the start-up
    line names their source, how to get the greedy answer, and how to turn them off."""
    import json
    import logging
    from nanovllm import LLM
    from nanovllm.utils.default_model import default_generation_config
    card = default_generation_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(qwen3_gqa, generation_config=card, max_model_len=64, cpu_kvcache_bytes=1 << 22):
            pass
        with LLM(qwen3_gqa, generation_config=card, override_generation_config={"temperature": 0, "max_new_tokens": 9},
                 max_model_len=64, cpu_kvcache_bytes=1 << 22):
            pass
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sampling defaults")]
    fields = json.loads((tmp_path / card.rsplit("/", 1)[-1] / "generation_config.json").read_text())
    assert lines == [
        f"sampling defaults from the default model's card: temperature={fields['temperature']}, "
        f"top_p={fields['top_p']}: requests that leave a field unset take it; send temperature=0 for a "
        "deterministic (greedy) answer (generation_config='vllm' / --generation-config vllm: none)",
        f"sampling defaults from the default model's card and override_generation_config: temperature=0, "
        f"top_p={fields['top_p']}, max_tokens=9: requests that leave a field unset take it; no request gets more "
        "than 9 tokens (generation_config='vllm' / --generation-config vllm: none)"]
