"""Pooling a prompt's final hidden states into one embedding (LLM.embed, /v1/embeddings), as vLLM's
pooling runner does for decoder models: the last token's state (Qwen3-Embedding and most decoder
embedders), the mean over the prompt, or the first token's ("cls"), then L2-normalised."""
import torch

POOLING = ("last", "mean", "cls")


def pool(hidden_states: torch.Tensor, lengths: list[int], method: str, normalize: bool = True) -> torch.Tensor:
    """[len(lengths), hidden] from hidden_states [sum(lengths), hidden] (prompts back to back)."""
    if method not in POOLING:
        raise ValueError(f"pooling must be one of {list(POOLING)}, got {method!r}")
    pieces = torch.split(hidden_states.float(), lengths)
    if method == "last":
        out = torch.stack([p[-1] for p in pieces])
    elif method == "cls":
        out = torch.stack([p[0] for p in pieces])
    else:
        out = torch.stack([p.mean(dim=0) for p in pieces])
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out
