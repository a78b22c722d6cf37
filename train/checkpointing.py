"""Activation checkpointing of transformer blocks (``torch.utils.checkpoint``, non-reentrant).

A checkpointed block keeps only its inputs in forward and recomputes its
activations during backward. Two ways in:

* a Hugging Face model that supports it gets ``activation_checkpointing_enable``
  (``gradient_checkpointing_enable`` before transformers 5)
  with ``use_reentrant=False`` (its decoder layers then checkpoint themselves);
* any other model: each block (an instance of ``block_classes``) gets an
  instance-level ``forward`` that runs the original forward under
  :func:`torch.utils.checkpoint.checkpoint`. Module hooks still run around the
  call (``__call__`` is untouched), and parameter names do not change.

Stage 3 cooperates: the recompute happens inside backward, after the block's
pre-backward gather (see ``[Note: stage-3 unit lifecycle]``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "checkpointed"]


def checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under non-reentrant activation checkpointing."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    run.__zspeed_checkpointed__ = True
    return run


def apply_activation_checkpointing(model: nn.Module, *, block_classes: Iterable[str | type] = ()) -> int:
    """Checkpoint the activations of every block of ``model``; returns how many blocks.

    Raises:
        ValueError: when no block is found (name the classes with ``block_classes``).
    """
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False  # a KV cache is pointless in training and conflicts with recompute
        return sum(1 for m in model.modules() if getattr(m, "gradient_checkpointing", False))
    classes = tuple(block_classes)
    count = 0
    for m in model.modules():
        if _is_block(m, classes) and not getattr(m.forward, "__zspeed_checkpointed__", False):
            m.forward = checkpointed(m.forward)
            count += 1
    if not count:
        raise ValueError(f"no block of classes {classes or '(none given)'} in {type(model).__name__}; pass "
                         "block_classes naming the module class to checkpoint (e.g. your transformer block)")
    return count


def _is_block(m: nn.Module, classes: tuple) -> bool:
    return any(type(m).__name__ == c if isinstance(c, str) else isinstance(m, c) for c in classes)
