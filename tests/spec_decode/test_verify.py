"""Acceptance (spec_decode/verify.py) against the speculative-sampling guarantee: whatever the
proposals, the emitted tokens are distributed as the target's own samples. Checked by a
chi-square test of the empirical joint distribution of the first two emitted tokens against the
exact one (p_0(a) * p_1(b | a)), for proposals drawn from a random q and for deterministic
(point-mass) proposals; the same test rejects an acceptance rule that ignores q. Greedy acceptance
by a hand count."""
import torch

from nanovllm.spec_decode.verify import accept, residual

V = 4
# Critical chi-square values at p = 1e-4 (the test is deterministic: seeded draws; a correct rule
# lands far below, a wrong one far above).
CHI2_CRITICAL = {3: 21.11, 15: 42.58}


def random_dist(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.softmax(2.0 * torch.randn(*shape, V, generator=gen), dim=-1)


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def simulate(num_trials: int, draft_q: bool, accept_q: bool = True, residual_q: bool = True, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two proposals per trial from q (draft_q) or fixed tokens (point masses); the target's rows
    depend on the earlier proposals as a model's would. Returns (counts of the first two emitted
    tokens [V, V], exact joint [V, V])."""
    gen = torch.Generator().manual_seed(seed)
    p0 = random_dist(gen)                      # p(a)
    p1 = random_dist(gen, V)                   # p(b | a)
    p2 = random_dist(gen, V, V)                # p(c | a, b): the bonus row
    q = random_dist(gen, 2) if draft_q else None
    drafts, rows, draft_probs = [], [], []
    for _ in range(num_trials):
        if draft_q:
            d = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        else:
            d = [2, 1]
        drafts.append(d)
        rows += [p0, p1[d[0]], p2[d[0], d[1]]]
        draft_probs.append(q)
    probs = torch.stack(rows)
    q_in_accept = draft_probs if (draft_q and accept_q) else None
    q_in_residual = draft_probs if (draft_q and residual_q) else None
    replacement = torch.multinomial(residual(probs, drafts, q_in_residual), 1, generator=gen).squeeze(1)
    uniform = torch.rand(len(rows), generator=gen)
    emitted = accept(probs.argmax(-1), probs, replacement, [False] * num_trials, drafts, uniform, q_in_accept)
    counts = torch.zeros(V, V)
    for e in emitted:
        if len(e) >= 2:
            counts[e[0], e[1]] += 1
        else:  # the first proposal was rejected: the second token comes from p(. | a) as the next step would draw
            counts[e[0], int(torch.multinomial(p1[e[0]], 1, generator=gen))] += 1
    return counts, p0[:, None] * p1


def test_random_draft_keeps_the_target_distribution():
    counts, exact = simulate(20000, draft_q=True)
    assert chi_square(counts.flatten(), exact.flatten()) < CHI2_CRITICAL[15]
    assert chi_square(counts.sum(1), exact.sum(1)) < CHI2_CRITICAL[3]


def test_point_mass_draft_keeps_the_target_distribution():
    counts, exact = simulate(20000, draft_q=False)
    assert chi_square(counts.flatten(), exact.flatten()) < CHI2_CRITICAL[15]


def test_acceptance_that_ignores_q_is_caught():
    """Proposals drawn from q, accepted with p(d) instead of min(1, p(d) / q(d)) (the residual
    still max(0, p - q)); and the other half of the same mistake, q in the acceptance but left
    out of the residual. The test must see both. (Leaving q out of both is the point-mass rule,
    which is exact for any proposal, only less often accepting: the residual p without d then
    makes up for it.)"""
    for accept_q, residual_q in ((False, True), (True, False)):
        counts, exact = simulate(20000, draft_q=True, accept_q=accept_q, residual_q=residual_q)
        assert chi_square(counts.flatten(), exact.flatten()) > 10 * CHI2_CRITICAL[15], (accept_q, residual_q)
    counts, exact = simulate(20000, draft_q=True, accept_q=False, residual_q=False)
    assert chi_square(counts.flatten(), exact.flatten()) < CHI2_CRITICAL[15]


def test_residual_is_the_normalised_positive_part():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.2, 0.6, 0.1, 0.1]])
    got = residual(p, [[1]], [q])
    assert torch.allclose(got[0], torch.tensor([0.3, 0.0, 0.1, 0.0]) / 0.4)
    assert torch.allclose(got[1], p[1])  # the bonus row draws from p itself
    got = residual(p, [[0]])  # point mass at 0: p without token 0
    assert torch.allclose(got[0], torch.tensor([0.0, 0.3, 0.2, 0.0]) / 0.5)
    same = residual(p[:1].repeat(2, 1), [[0]], [p[:1]])  # q == p: nothing can be rejected; p stays
    assert torch.allclose(same[0], p[0])


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    # Two sequences: proposals [5, 6, 7] against argmaxes [5, 6, 9, 4] -> 5, 6, then 9;
    # proposals [3] against [8, 2] -> 8 alone.
    target = torch.tensor([5, 6, 9, 4, 8, 2])
    emitted = accept(target, None, None, [True, True], [[5, 6, 7], [3]], None)
    assert emitted == [[5, 6, 9], [8]]
    assert accept(torch.tensor([5, 6, 7, 1]), None, None, [True], [[5, 6, 7]], None) == [[5, 6, 7, 1]]
