"""Perplexity of a causal language model on a token stream."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .data import windows


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 512, max_windows: int | None = None,
               batch_size: int = 4) -> float:
    """``exp`` of the mean next-token NLL over non-overlapping ``seq_len`` windows.

    ``model(input_ids)`` must return logits ``(B, T, V)`` (or an object with
    ``.logits``). Each window predicts its last ``seq_len - 1`` tokens.
    """
    device = next(model.parameters()).device
    wins = windows(tokens, seq_len=seq_len, count=max_windows)
    nll, count = 0.0, 0
    for i in range(0, len(wins), batch_size):
        ids = torch.cat(wins[i:i + batch_size]).to(device)  # (B, T)
        out = model(ids)
        logits = getattr(out, "logits", out).float()  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                               reduction="sum")
        nll += loss.item()
        count += ids[:, 1:].numel()
    return math.exp(nll / count)
