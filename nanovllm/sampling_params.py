"""SamplingParams: per-request decoding options, validated at construction."""
from dataclasses import dataclass


def _check_number(name: str, value, *, integer: bool = False) -> None:
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")


@dataclass
class SamplingParams:
    """Decoding options of one request.

    temperature 0 means greedy (argmax); temperature > 0 samples from softmax(logits / T).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        self.temperature = float(self.temperature)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
