"""The routing and the reference of a mixture of experts, in plain torch: select_experts (the
router's top-k) and experts_reference (the grouped loop every experts kernel is tested against,
and the dense method's path where no kernel runs)."""
from dataclasses import dataclass

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


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek-V3 / GLM-4.5's router: each expert scores sigmoid(logit); the experts are chosen by
    score + correction bias, only among the topk_group groups (num_experts / n_group experts each)
    whose two best biased scores sum highest; the weights are the chosen experts' unbiased scores
    (renormalized over them when asked), times scale (routed_scaling_factor)."""

    n_group: int
    topk_group: int
    scale: float


def select_grouped(router_logits: torch.Tensor, top_k: int, renormalize: bool, grouped: GroupedTopK,
                   correction_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]) by GroupedTopK's rule."""
    scores = torch.sigmoid(router_logits.float())
    choice = scores + correction_bias.float()
    tokens, experts = choice.shape
    per_group = experts // grouped.n_group
    best_two = choice.view(tokens, grouped.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
    groups = best_two.topk(grouped.topk_group, dim=-1)[1]
    allowed = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * grouped.scale, ids


def route(layer, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A FusedMoE layer's (weights, ids) for its router logits: its grouped rule where it has one,
    else the softmax top-k (select_experts)."""
    if layer.grouped is not None:
        return select_grouped(router_logits, layer.top_k, layer.renormalize, layer.grouped,
                              layer.e_score_correction_bias)
    return select_experts(router_logits, layer.top_k, layer.renormalize)


def activate(gate: torch.Tensor, up: torch.Tensor, activation=None) -> torch.Tensor:
    """The experts' activation (layers/moe.py, ExpertActivation; None: silu(gate) up)."""
    if activation is None or activation.name == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    return (up + 1) * gate * torch.sigmoid(gate * activation.alpha)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                      activation=None, lora: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, expert e's MLP being
    w2[e] act(gate, up) (+ b2[e]) with gate | up = w13[e] x (+ b13[e]): tokens grouped by expert,
    each expert that receives a token run once over its tokens. lora: each expert's low-rank updates
    (A13 [E, r, H], B13 [E, 2I, r], A2 [E, r, I], B2 [E, H, r]; lora/experts.py) added to its gate | up
    and down products."""
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
        b13, b2 = (None, None) if biases is None else (biases[0][e].to(x.dtype), biases[1][e].to(x.dtype))
        xt = x[tokens]
        gate_up = F.linear(xt, w13[e], b13)
        if lora is not None:
            gate_up = gate_up + (xt @ lora[0][e].t()) @ lora[1][e].t()
        h = activate(*gate_up.chunk(2, dim=-1), activation)
        y = F.linear(h, w2[e], b2)
        if lora is not None:
            y = y + (h @ lora[2][e].t()) @ lora[3][e].t()
        out.index_add_(0, tokens, y.float() * weights.flatten()[pairs, None])
    return out.to(x.dtype)


def c_experts(kernels, layer, gate_up_views: list, down_views: list):
    """The C description (kernels/cpu_kernels.py, MoeExperts) of a FusedMoE layer's experts from
    their weight views, with the layer's routing (its grouped rule and correction bias too), biases
    and activation."""
    from nanovllm.kernels import cpu_kernels
    act = layer.activation
    bias = None
    if layer.grouped is not None:
        bias = layer.e_score_correction_bias.data = layer.e_score_correction_bias.data.float().contiguous()
    return cpu_kernels.moe_experts_struct(kernels, gate_up_views, down_views, layer.top_k, layer.renormalize,
                                          biases=layer.biases, activation=(act.name, act.alpha, act.limit),
                                          grouped=layer.grouped, correction_bias=bias)
