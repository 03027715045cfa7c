"""`nanovllm serve`'s chat flags (vLLM's names): parsed into ChatSettings, mistakes refused in one
line (exit 2) before any model loads."""
import pytest

from nanovllm.cli import build_parser

from cli_helpers import one_error_line, run


def test_chat_flags_parse():
    args = build_parser().parse_args(["serve", "m", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                                      "--trust-request-chat-template"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.trust_request_chat_template) == \
        ("hermes", True, True)
    args = build_parser().parse_args(["serve", "m"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.trust_request_chat_template) == \
        (None, False, False)


@pytest.mark.parametrize("flags, words", [
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--tool-call-parser", "nope"], "'nope'"),
])
def test_bad_chat_flags_are_one_line(flags, words, tmp_path):
    # The folder does not exist: the flags are refused before the model folder is even looked at.
    line = one_error_line(run("-m", "nanovllm.cli", "serve", str(tmp_path / "nope"), "--port", "0", *flags,
                              cache=tmp_path))
    assert line.startswith("nanovllm serve: error:") and words in line
