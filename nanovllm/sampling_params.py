"""SamplingParams: per-request decoding options with vLLM's names, meanings and defaults.

Validated at construction; the sampler (sample/sampling_metadata.py) and the engine read them.
"""
import json
import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (vLLM's rule); positive ones below MIN_TEMPERATURE are raised
# to it, because logits / 1e-4 overflow softmax into NaN.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
# Most completions one request may ask for: the engine builds one Sequence per completion up
# front, so an unbounded n would let one call allocate without limit.
MAX_N = 1024
# Most prompt_logprobs one request may ask for (vLLM's default max_logprobs): each prompt position
# carries that many entries, so the output grows with prompt length times this.
MAX_PROMPT_LOGPROBS = 20


def _check_number(name: str, value, *, integer: bool = False, none_means: str | None = None) -> None:
    """none_means: what None stands for, where the field also takes None (said in the message)."""
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an int" if integer else "a number"
        alternative = f", or None for {none_means}" if none_means else ""
        raise TypeError(f"{name} must be {kind}{alternative}, got {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_range(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's names): set exactly one of the fields.

    json: a JSON schema (dict, or its JSON text); json_object: True for any JSON object;
    regex: a regular expression the whole output matches; choice: the output is one of these
    strings; grammar: an EBNF grammar (GBNF, llama.cpp's dialect, with a `root` rule).
    starts_after: the constraint applies only once the output holds this text's tokens (a
    reasoning model's "</think>": the thinking is free, the answer constrained); None: from the
    first token. The server sets it with --reasoning-parser.
    Checked for shape here; compiled (and a bad schema / regex / grammar refused with a
    ValueError) when the engine takes the request. Needs the `grammar` extra (xgrammar).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    starts_after: str | None = None

    def __post_init__(self) -> None:
        if self.starts_after is not None and (not isinstance(self.starts_after, str) or not self.starts_after):
            raise ValueError(f"structured_outputs.starts_after must be a non-empty string, got {self.starts_after!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
            if self.json_object:
                given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.json is not None:
            self._check_json()
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)

    def _check_json(self) -> None:
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON text: {e}") from None
        else:
            schema = self.json
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(schema).__name__} {schema!r}")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): equal keys compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            return kind, json.dumps(value, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(value)
        return kind, value


@dataclass
class SamplingParams:
    """Decoding options of one request (field names and defaults follow vLLM, except max_tokens=64).

    temperature: 0 (below 1e-5) means greedy argmax; otherwise sample from softmax(logits / T).
    top_k: keep the k most likely tokens (0 or -1: off). top_p: keep the smallest set of tokens
    whose probability reaches top_p, the token that crosses it included. min_p: drop tokens less
    likely than min_p times the most likely one. Order: penalties, temperature, min_p, top_k, top_p.
    seed: this request's draws depend only on the seed and the step, never on its batch companions.
    max_tokens: most new tokens (None: up to max_model_len). min_tokens: EOS and stop_token_ids
    are masked, and stop strings not checked, until this many tokens exist.
    stop: strings that end the output; the text is cut before them unless
    include_stop_str_in_output. stop_token_ids: token ids that end the output (finish "stop").
    repetition_penalty (> 0, 1 = off): logits of tokens seen in prompt or output are divided by it
    when positive, multiplied when negative. presence_penalty / frequency_penalty ([-2, 2]):
    subtracted once per token present in the output / once per occurrence.
    logprobs: return, for each generated token, the log-probabilities (of the raw model logits,
    before penalties and temperature) of the top `logprobs` tokens plus the chosen one.
    prompt_logprobs: return, for each prompt token, its log-probability given the tokens before it
    plus the top `prompt_logprobs` tokens at that position (raw model logits; the first token: None).
    spaces_between_special_tokens: False decodes the text between added (special) tokens apart from
    them and joins all with nothing between (vLLM's option; True: the tokenizer's own decode).
    n: completions per prompt; they share the prompt's KV blocks through the prefix cache.
    structured_outputs: constrain the output to a JSON schema, regex, choice or grammar (see
    StructuredOutputsParams); applied to the logits before every other option; the output ends
    ("stop") when the grammar can go no further.
    """

    temperature: float = 1.0
    max_tokens: int | None = 64
    ignore_eos: bool = False
    n: int = 1
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_lengths()
        self._check_stops()
        self._check_penalties()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            _check_bool(name, getattr(self, name))
        _check_number("n", self.n, integer=True)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True, none_means="no per-request seed")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True, none_means="no logprobs")
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be >= 0, or None for no logprobs, got {self.logprobs}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams, or None for no constraint, got "
                            f"{type(self.structured_outputs).__name__} {self.structured_outputs!r}")
        if self.prompt_logprobs is not None:
            _check_number("prompt_logprobs", self.prompt_logprobs, integer=True, none_means="no prompt logprobs")
            if not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], or None for no "
                                 f"prompt logprobs, got {self.prompt_logprobs}")

    def _check_sampling(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            _check_number("temperature", self.temperature)  # raises the TypeError
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 for no top-k, got {self.top_k}")
        _check_number("min_p", self.min_p)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncations cannot change the argmax, so drop them (the sampler skips work).
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        elif self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g and would overflow softmax; using %g",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    def _check_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True, none_means="no limit")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, or None for no limit, got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    def _check_stops(self) -> None:
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop must be a string, a list of strings or None, got {type(stop).__name__} {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must hold strings only, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError(f"stop must not contain an empty string, got {list(stop)!r}")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of ints or None, got {type(ids).__name__} {ids!r}")
        for t in ids:
            _check_number("stop_token_ids item", t, integer=True)
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        self.stop_token_ids = list(ids)

    def _check_penalties(self) -> None:
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            _check_range(name, value, -2.0, 2.0)
            setattr(self, name, float(value))
        self.repetition_penalty = float(self.repetition_penalty)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
