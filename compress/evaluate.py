"""Perplexity of a causal language model on a token stream."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .data import windows


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 512, max_windows: int | None = None,
               batch_size: int = 4, progress: bool = False) -> float:
    """``exp`` of the mean next-token NLL over non-overlapping ``seq_len`` windows.

    ``model(input_ids)`` must return logits ``(B, T, V)`` (or an object with
    ``.logits``). Each window predicts its last ``seq_len - 1`` tokens.
    ``progress``: a progress bar over windows on stderr.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is invalid: a window needs at least 2 tokens (one to predict)")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows={max_windows} is invalid: use at least 1 (or None for all)")
    device = next(model.parameters()).device
    wins = windows(tokens, seq_len=seq_len, count=max_windows)
    nll, count = 0.0, 0
    bar = tqdm(total=len(wins), desc="perplexity", unit="window", disable=not progress)
    for i in range(0, len(wins), batch_size):
        ids = torch.cat(wins[i:i + batch_size]).to(device)  # (B, T)
        out = model(ids)
        logits = getattr(out, "logits", out).float()  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                               reduction="sum")
        nll += loss.item()
        count += ids[:, 1:].numel()
        bar.update(ids.shape[0])
    bar.close()
    return math.exp(nll / count)
