"""Structured outputs: grammars compiled by xgrammar (cached), one matcher per sequence, a step's
token bitmask and its application to the logits. LLMEngine compiles and advances; SamplingMetadata
fills the bitmask on rank 0; the Sampler applies it. xgrammar is imported lazily (the `grammar` extra).
"""
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from nanovllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # NOTE: annotations only: the sampler sits below the engine and never imports it
    from nanovllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 128  # compiled grammars kept, least recently used dropped first
# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest is the useful part.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package: "
                         "pip install 'nano-vllm[grammar]'") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    # JSON string escapes (\" \\ \n \uXXXX) are the EBNF literal's escapes too.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiles StructuredOutputsParams into xgrammar CompiledGrammars over one tokenizer, keyed by
    (kind, spec), and makes per-sequence matchers from them.

    vocab_size: the model's (its logits' width; may exceed the tokenizer's). stop_token_ids: the
    engine's EOS ids, the only tokens that end a grammar. NOTE: the server compiles a request's
    grammar on its preparation thread while the engine thread makes matchers: the cache and the
    compiler's creation are under a lock (a compile itself is not: two threads may both compile one
    spec, and the later result is kept).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset | set):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            return self._compiler or self._new_compiler()

    def _new_compiler(self):
        if self._compiler is None:
            xgr = import_xgrammar()
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer, and this model folder has none")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params; a bad schema / regex / grammar raises ValueError."""
        key = params.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = self._compile(params)
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        compiler, kind = self.compiler(), params.kind
        try:
            if kind == "json":
                # Compact JSON (no free whitespace): a model cannot pad the output with blanks forever.
                return compiler.compile_json_schema(params.json, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as e:  # xgrammar reports every bad spec this way
            message = _SOURCE_PREFIX.sub("", str(e).strip()).splitlines()[0]
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
            raise ValueError(f"structured_outputs.{kind} is not a valid {what}: {message}") from None

    def new_matcher(self, params: StructuredOutputsParams):
        """A fresh matcher (at the grammar's start) for one sequence; with params.starts_after, one
        that lets every token through until the output holds that text's tokens."""
        matcher = import_xgrammar().GrammarMatcher(self.compile(params))
        if params.starts_after is None:
            return matcher
        marker = self.tokenizer.encode(params.starts_after, add_special_tokens=False)
        if not marker:
            raise ValueError(f"structured_outputs.starts_after {params.starts_after!r} encodes to no tokens")
        return DeferredMatcher(matcher, marker)


class DeferredMatcher:
    """A grammar matcher that starts after a marker (the end of a reasoning model's thinking):
    until the output's tokens end with `marker`, every token is allowed and nothing ends; then the
    grammar matches from its start. Has the matcher methods the sampler, the engine and speculative
    verification call (fill_next_token_bitmask, accept_token, rollback, is_terminated)."""

    def __init__(self, matcher, marker: list[int]):
        self.matcher, self.marker = matcher, list(marker)
        self.before: list[int] = []  # the tokens accepted before the grammar started
        self.started = False
        self.num_after = 0  # tokens the inner matcher has accepted

    @property
    def stop_token_ids(self):
        return self.matcher.stop_token_ids

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.started:
            self.matcher.fill_next_token_bitmask(bitmask, index)
        else:
            bitmask[index].fill_(-1)  # every bit set: any token

    def accept_token(self, token: int) -> bool:
        if self.started:
            accepted = self.matcher.accept_token(token)
            self.num_after += bool(accepted)
            return accepted
        self.before.append(token)
        self.started = self.before[-len(self.marker):] == self.marker
        return True

    def is_terminated(self) -> bool:
        return self.started and self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        inner = min(num_tokens, self.num_after)
        if inner:
            self.matcher.rollback(inner)
            self.num_after -= inner
        outer = num_tokens - inner
        if outer:
            del self.before[-outer:]
            self.started = False


def fill_bitmask(seqs: "list[Sequence]", is_sampled: list[bool],
                 vocab_size: int) -> tuple[list[int], torch.Tensor] | None:
    """The rows of a step with a grammar and their allowed tokens: an int32 bitmask on the host,
    [num_grammar_rows, ceil(vocab_size / 32)], bit t % 32 of word t // 32 set when token t may
    come next. None when no sampled row has a grammar (mid-prompt chunks never do)."""
    rows = [i for i, (seq, s) in enumerate(zip(seqs, is_sampled)) if s and seq.grammar is not None]
    if not rows:
        return None
    xgr = import_xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for j, i in enumerate(rows):
        matcher = seqs[i].grammar
        matcher.fill_next_token_bitmask(bitmask, j)
        if not bool(bitmask[j].any()):  # an empty language (`root ::= root`): let it end on EOS
            for t in matcher.stop_token_ids:
                bitmask[j, t // 32] |= _bit(t % 32)
    return rows, bitmask


def _bit(b: int) -> int:
    """Bit b of an int32 word as a Python int that fits one (bit 31 is the sign)."""
    return 1 << b if b < 31 else -(1 << 31)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [num_rows, vocab] with the tokens a row's bitmask forbids set to -inf (out of place);
    rows [num_grammar_rows] (int64) index the logits rows bitmask [num_grammar_rows, words] covers."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # [num_grammar_rows, words, 32] -> [num_grammar_rows, words * 32]: bit b of word w is token 32w + b.
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    assert allowed.shape[1] >= vocab, "the bitmask must cover the whole vocabulary"
    masked = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits.index_copy(0, rows, masked)


def advance(seqs: "list[Sequence]", is_sampled: list[bool]) -> list["Sequence"]:
    """Feed each sampled row's new token to its matcher (after Scheduler.postprocess appended it);
    returns the running sequences whose grammar has now ended, for the caller to finish ("stop")."""
    return [seq for seq, sampled in zip(seqs, is_sampled) if sampled and advance_one(seq)]


def advance_one(seq: "Sequence") -> bool:
    """Feed seq's new token (its last) to its matcher; whether seq is running and its grammar has
    now ended (the caller finishes it, "stop")."""
    if seq.grammar is None or seq.grammar.is_terminated():
        return False
    if not seq.grammar.accept_token(seq.last_token):
        # The bitmask allowed only tokens the matcher accepts, unless the grammar allows none
        # (an empty language: fill_bitmask let EOS through): end that one output alone.
        logger.warning("sequence %s: its grammar allows no token; ending it", seq.seq_id)
        return not seq.is_finished
    return seq.grammar.is_terminated() and not seq.is_finished
