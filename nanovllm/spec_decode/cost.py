"""What a verification step costs, measured once at start-up, and the proposal length that pays.

A step's time grows with its rows in steps, not evenly: on a CPU the first row pays for reading
every weight (memory-bound), each further row adds its arithmetic (on 2 AVX2 cores a Q8_0 135M
model: 7.7 ms for one row, +1.5-2 ms per row after; an F16 file: 15.7 ms for one row, 19.8 ms for
four, 29 ms for five, where the dense tile of four rows is full); on a GPU rows are almost free
until the batch is large. So the table of step time by row count is measured on the engine's own
runner (and the draft's) when speculation starts, and each step the Speculator picks the longest
proposal length L (per sequence at most its own earned length) that maximises expected tokens per
second:

    tokens(L) = sum_i (1 + a_i + a_i^2 + ... + a_i^l_i),  l_i = min(cap_i, L)
    time(L)   = target(sum_i (1 + l_i)) + sum_{j=1..L} draft(rows of draft step j)

(the draft's first step: the positions its cache lacks, a whole prompt for a sequence whose
prefill it skipped),

with a_i the sequence's acceptance rate (AcceptanceRates). L = 0 (no proposals) wins when rows are
expensive next to what they earn: large batches, low acceptance. Measured thresholds, per machine
and model, in place of one fixed batch size.
"""
import time

import torch

# Rows measured at start-up (more are extrapolated from the last two); a few forwards each.
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
REPEATS = 3


class StepTimes:
    """Seconds of one forward by its number of rows, from a measured table."""

    def __init__(self, table: dict[int, float]):
        self.rows = sorted(table)
        self.table = table

    def __call__(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        if rows in self.table:
            return self.table[rows]
        below = [r for r in self.rows if r < rows]
        above = [r for r in self.rows if r > rows]
        if below and above:  # a row count between two measured ones costs the larger
            return self.table[above[0]]
        if not below:
            return self.table[self.rows[0]]
        a, b = self.rows[-2], self.rows[-1]  # past the table: the last slope
        return self.table[b] + (rows - b) * (self.table[b] - self.table[a]) / (b - a)

    @classmethod
    def linear(cls, fixed: float, per_row: float) -> "StepTimes":
        return cls({r: fixed + per_row * r for r in (1, 2)})


@torch.inference_mode()
def measure_step_times(runner, max_rows: int) -> StepTimes:
    """Time forwards of 1..max_rows decode rows on runner (a ModelRunner whose KV cache holds no
    request yet: the rows write into blocks 0.. and attend to one block each)."""
    block_size = runner.block_size
    rows_to_measure = [r for r in MEASURED_ROWS if r <= max_rows] or [1]
    table = {}
    for rows in rows_to_measure:
        tables = [[i] for i in range(rows)]
        positions = [block_size - 1] * rows
        tokens = [0] * rows
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            logits = runner.run_model(*runner.prepare_rows(tokens, positions, tables), None)
            float(logits[0, 0])  # waits for the device
            best = min(best, time.perf_counter() - start)
        table[rows] = best
    return StepTimes(table)


class AcceptanceRates:
    """Each sequence's chance that a proposal is accepted, from its verifications: every
    proposal up to and including the first rejected one is a trial; older verifications weigh
    less (DECAY per verification, and per step the sequence went without proposals). A sequence
    with no history gets the proposer's prior, worth PRIOR_TRIALS trials: a few misses bring it
    down; one left without proposals drifts back to the prior and is tried again."""

    DECAY = 0.8
    PRIOR_TRIALS = 2.0

    def __init__(self, prior: float):
        self.prior = prior
        self.counts: dict[int, tuple[float, float]] = {}

    def rate(self, seq_id: int) -> float:
        s, t = self.counts.get(seq_id, (0.0, 0.0))
        return (s + self.prior * self.PRIOR_TRIALS) / (t + self.PRIOR_TRIALS)

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        s, t = self.counts.get(seq_id, (0.0, 0.0))
        if drafted == 0:  # no proposals this step: the history weighs less
            if t:
                self.counts[seq_id] = (self.DECAY * s, self.DECAY * t)
            return
        trials = accepted + (1 if accepted < drafted else 0)
        self.counts[seq_id] = (self.DECAY * s + accepted, self.DECAY * t + trials)

    def forget(self, seq_id: int) -> None:
        self.counts.pop(seq_id, None)


def expected_tokens(length: int, rate: float) -> float:
    """Tokens a verification of `length` proposals emits on average (1 + a + ... + a^length)."""
    return sum(rate ** j for j in range(length + 1))


def best_length(caps: list[int], rates: list[float], target: StepTimes, draft: StepTimes | None,
                pending: list[int] | None = None) -> int:
    """The proposal length L (each sequence min(cap_i, L)) with the most expected tokens per
    second; 0 when no proposal pays. draft: the draft model's forward times (None: proposals cost
    nothing to make). The first draft step also computes the positions each sequence's draft cache
    lacks (pending[i] rows; two when not given: the last token, and the last proposal after a
    verification that accepted everything)."""
    pending = pending if pending is not None else [2] * len(caps)
    best, best_rate = 0, len(caps) / target(len(caps))
    for length in range(1, max(caps, default=0) + 1):
        lengths = [min(c, length) for c in caps]
        tokens = sum(expected_tokens(n, a) for n, a in zip(lengths, rates))
        seconds = target(sum(1 + n for n in lengths))
        if draft is not None:
            seconds += draft(sum(p for n, p in zip(lengths, pending) if n >= 1))
            for j in range(2, length + 1):
                seconds += draft(sum(1 for n in lengths if n >= j))
        if tokens / seconds > best_rate * 1.0001:
            best, best_rate = length, tokens / seconds
    return best
