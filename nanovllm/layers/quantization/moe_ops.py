"""The routing and the reference of a mixture of experts, in plain torch: select_experts (the
router's top-k) and experts_reference (the grouped loop every experts kernel is tested against,
and the dense method's path where no kernel runs)."""
import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]) of each token: the top_k of the
    router's softmax (computed in fp32), divided by their sum when renormalize."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, expert e's MLP being
    w2[e] (silu(gate) * up) with gate | up = w13[e] x: tokens grouped by expert, each expert that
    receives a token run once over its tokens."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // ids.shape[1]
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]).float()
        out.index_add_(0, tokens, y * weights.flatten()[pairs, None])
    return out.to(x.dtype)
