"""Prompt-lookup decoding (vLLM's "ngram"): the tokens that followed the last earlier occurrence of
the sequence's final n tokens, for n from prompt_lookup_max down to prompt_lookup_min. Costs no
forward pass: copy-heavy requests (quoting, rewriting, editing code, repeated tool output) get
long runs accepted, others mostly get no proposal at all."""
import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.spec_decode.proposer import Proposer


def find_continuation(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier match of tokens' last n tokens (largest n
    first); [] when no suffix of n_min tokens or more occurred before."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # Windows of n tokens starting at 0 .. length - n - 1 (not the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the text most like what follows
            return tokens[start: start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int):
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [find_continuation(np.asarray(seq.token_ids, dtype=np.int64), self.n_max, self.n_min, k) if k > 0
                else [] for seq, k in zip(seqs, num_tokens)]
