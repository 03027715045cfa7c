"""Counts of speculation: proposals made and accepted, tokens emitted, acceptance per position.
vLLM's metrics (vllm:spec_decode_*) are read from these; bench output prints summary()."""
from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0            # verifications of a sequence that had proposals
    num_draft_tokens: int = 0      # proposals verified
    num_accepted_tokens: int = 0   # proposals accepted
    num_emitted_tokens: int = 0    # tokens from those verifications (accepted + the target's own)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_emitted_tokens": self.num_emitted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate_per_position": [round(a / self.num_drafts, 4) if self.num_drafts else 0.0
                                                 for a in self.accepted_per_position]}

    def summary(self) -> str:
        d = self.as_dict()
        return (f"speculation: {d['num_draft_tokens']} proposed, {d['num_accepted_tokens']} accepted "
                f"({100 * d['acceptance_rate']:.1f}%), {d['num_emitted_tokens']} emitted in {d['num_drafts']} "
                f"verifications; accepted per position {d['acceptance_rate_per_position']}")
