"""Picking the next token from logits: greedy, temperature, top-k, top-p, per-request seeds.

Each sampled sequence draws from a ``torch.Generator`` of its own, seeded with
the request's seed (or a fresh random one), so a seeded request samples the
same tokens whatever it is batched with. The filters follow the usual order
(temperature, then top-k, then top-p) and are plain functions on a row of
logits.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .request import SamplingParams


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Sets all but the ``k`` largest logits to -inf (``k <= 0`` keeps all). ``logits``: ``(V,)``."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches ``p`` (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
    drop = mass_before >= p
    drop[0] = False
    unsorted = torch.empty_like(drop).scatter_(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(unsorted, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from; ``logits`` ``(V,)`` float32."""
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return logits.softmax(-1)


class Sampler:
    """Samples one token per row of logits; keeps each sequence's generator until :meth:`free`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams]]) -> dict[int, list[int]]:
        """``logits`` ``(S, V)`` float32, one row per ``(seq_id, params)`` of ``rows``; returns new tokens."""
        tokens = logits.argmax(-1)  # (S,) greedy for every row; sampled rows are overwritten below
        for i, (seq_id, params) in enumerate(rows):
            if not params.greedy:
                probs = sampling_probs(logits[i], params)
                tokens[i] = torch.multinomial(probs, 1, generator=self._generator(seq_id, params.seed))[0]
        return {seq_id: [token] for (seq_id, _), token in zip(rows, tokens.tolist())}

    def free(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: int, seed: int | None) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = torch.Generator(device=self.device)
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(seed)
        return gen
