"""Sampler: one token per row from final logits; greedy rows take argmax, others Gumbel-max."""
import torch
from torch import nn


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """logits [num_seqs, vocab], temperatures [num_seqs] (0 = greedy) -> token ids [num_seqs]."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        is_greedy = temperatures == 0
        if bool(is_greedy.all()):
            return greedy
        t = torch.where(is_greedy, torch.ones_like(temperatures), temperatures)
        probs = torch.softmax(logits / t.unsqueeze(-1), dim=-1)
        # Gumbel-max in exponential form: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_(1.0).clamp_min_(1e-10)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)
