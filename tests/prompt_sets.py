"""Prompt sets the equivalence and parity tests share."""
import random


SHARED = list(range(3, 3 + 40))  # a 40-token prefix: 2 full blocks of 16 and a partial one


def prompts_with_shared_prefix() -> list[list[int]]:
    return [SHARED + [100 + i] * (i + 1) for i in range(4)] + [SHARED[:32]] + mixed_prompts(seed=3)


def mixed_prompts(vocab: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 33, 50)]

