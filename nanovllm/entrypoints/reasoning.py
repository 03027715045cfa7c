"""Reasoning parsers (`nanovllm serve --reasoning-parser NAME`, vLLM's names): a reply's thinking,
written between <think> and </think>, returned apart from its answer (chat completions'
`reasoning_content`, streamed deltas too).

- qwen3: the thinking is a leading <think>...</think> block; a reply without one is all answer
  (Qwen3 with enable_thinking false, whose template writes an empty block into the prompt).
- deepseek_r1: the template opens <think> in the prompt, so the reply starts inside the thinking
  (a leading <think> is dropped too); everything up to </think> is thinking, and a reply that
  never closes it (cut off by max_tokens) is all thinking.
"""
from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_thinking: bool  # the reply begins inside the thinking (the prompt opened it)

    def split(self, text: str) -> tuple[str | None, str]:
        """(thinking or None, answer) of a whole reply."""
        stream = self.stream()
        reasoning, content = stream.feed(text, finished=True)
        return (reasoning if stream.saw_thinking else None), content

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.starts_thinking)


class ReasoningStream:
    """One reply read piece by piece: feed() returns the new (thinking, answer) text, holding back
    an end that could be the start of a tag until the next piece tells."""

    def __init__(self, starts_thinking: bool):
        # "open": nothing decided yet (a reply may start with <think>); "thinking"; "after" (past
        # </think>, before the answer's first character); "answer".
        self.state = "open"
        self.starts_thinking = starts_thinking
        self.held = ""
        self.saw_thinking = False

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        reasoning = content = ""
        while text:
            if self.state == "open":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.state, self.saw_thinking = "thinking", True
                    text = stripped[len(START):]
                elif START.startswith(stripped) and not finished:  # "<thi" so far: wait
                    self.held = text
                    return reasoning, content
                elif self.starts_thinking:
                    self.state, self.saw_thinking = "thinking", True
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = text.find(END)
                if end >= 0:
                    reasoning += text[:end]
                    text = text[end + len(END):]
                    self.state = "after"
                    continue
                keep = 0 if finished else _partial_tag(text, END)
                reasoning += text[:len(text) - keep]
                self.held = text[len(text) - keep:]
                return reasoning, content
            elif self.state == "after":  # the newlines between </think> and the answer are neither
                text = text.lstrip("\n")
                if text:
                    self.state = "answer"
            else:
                content += text
                text = ""
        return reasoning, content


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters are the start of tag (kept until the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS = {"qwen3": ReasoningParser("qwen3", starts_thinking=False),
           "deepseek_r1": ReasoningParser("deepseek_r1", starts_thinking=True)}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known; choose from {sorted(PARSERS)}")
    return PARSERS[name]
