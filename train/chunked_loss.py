"""The causal-LM loss without the full logits: a transform on a Hugging Face model.

A causal LM's forward with ``labels`` builds the logits of every position, ``(B, T, V)``, and its loss
upcasts them to fp32 and keeps the log-softmax for backward. For a 32 K vocabulary at 4 x 2048 tokens that
is ~3 GB alive at the loss, which is where a training step's memory peaks (benchmarks/RESULTS.md, offload
run 23). :func:`chunk_lm_loss` makes the model compute the same loss a chunk of positions at a time.

[Note: chunked loss] ``ChunkedLMLoss`` is one autograd node over the final hidden states and the head's
weight (and bias). Forward walks the positions, a chunk at a time: the chunk's logits (the head in the
model's dtype, then fp32, as the model's own loss does), their log-sum-exp and the target's logit; only
the log-sum-exp (4 bytes per position) is kept. Backward walks the vocabulary: each slice of the head's
rows gets the logits of every position, turned into ``softmax - one_hot`` in place with the kept
log-sum-exp, then ``grad_W[slice] = g^T @ h`` (one product over all positions, like the model's own
backward, written straight into the gradient) and ``grad_hidden += g @ W[slice]`` (fp32, cast once). So
beyond the model's activations one chunk's fp32 logits are alive (about ``max_chunk_bytes``), and in
backward an fp32 copy of the hidden states' gradient. The head's weight gets one gradient from one node,
as in the unchunked model: engines that hook gradient accumulation (ZeRO 2-3) see it once per backward.

The loss is the model's own ``ForCausalLMLoss``: labels shifted left by one, ``ignore_index`` counted for
nothing, the mean over counted positions or the sum over ``num_items_in_batch``. It equals the unchunked
loss up to the order of fp32 sums (CPU tests: the loss and every gradient against the model's own
forward). Ignored positions are computed with weight 0 rather than filtered out: filtering needs their
count on the host, a synchronisation per step; the model's own loss computes them too.

Measured (benchmarks/RESULTS.md, offload session 13): the ZeRO-2 + offload step of the 1.1 B workload peaks
2.5 GiB lower (19.80 -> 17.28 GiB), which ``offload_optimizer.ratio`` turns into optimizer state kept on
the GPU.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ChunkedLossConfig", "ChunkedLMLoss", "chunk_lm_loss", "unchunk_lm_loss", "chunked_lm_loss"]

_MARK = "_zspeed_chunked_loss"  # set on a model whose loss chunk_lm_loss chunks
_UNSUPPORTED = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkedLossConfig:
    """``max_chunk_bytes``: fp32 logits per chunk (the positions per chunk follow from the vocabulary);
    ``ignore_index``: the label that counts for nothing (Hugging Face's -100)."""

    max_chunk_bytes: int = 128 << 20
    ignore_index: int = -100

    def __post_init__(self) -> None:
        if not isinstance(self.max_chunk_bytes, int) or self.max_chunk_bytes < 4:
            raise ValueError(f"ChunkedLossConfig.max_chunk_bytes must be an int of at least 4 (one fp32 logit), "
                             f"got {self.max_chunk_bytes!r}")
        if not isinstance(self.ignore_index, int):
            raise ValueError(f"ChunkedLossConfig.ignore_index must be an int, got {self.ignore_index!r}")


class ChunkedLMLoss(torch.autograd.Function):
    """``loss = sum_i w_i [lse(h_i W^T + b) - (h_i W^T + b)[t_i]]`` over positions ``i`` (see [Note: chunked
    loss]). ``hidden`` ``(N, H)``; ``targets`` ``(N,)`` already shifted; ``weights`` ``(N,)`` fp32, 0 where the
    label is ignored (no host synchronisation: the positions are not filtered)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, max_bytes: int):
        rows = max(1, max_bytes // (4 * weight.shape[0]))
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        ctx.compute_dtype = hidden.dtype
        for lo in range(0, hidden.shape[0], rows):
            logits = F.linear(hidden[lo:lo + rows], weight, bias)  # (n, V), in autocast's dtype if it is on
            ctx.compute_dtype = logits.dtype
            logits = logits.float()
            lse[lo:lo + rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[lo:lo + rows, None]).squeeze(1)
            total += ((lse[lo:lo + rows] - picked) * weights[lo:lo + rows]).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, weights, lse)
        ctx.max_bytes = max_bytes
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, targets, weights, lse = ctx.saved_tensors
        coeff = (weights * grad_loss.float())[:, None]  # (n, 1)
        n, vocab = hidden.shape[0], weight.shape[0]
        cols = max(1, ctx.max_bytes // (4 * max(n, 1)))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        cd = ctx.compute_dtype  # the forward's product dtype (autocast's, under autocast), kept for the recompute
        h = hidden.to(cd)
        for lo in range(0, vocab, cols):
            w = weight[lo:lo + cols].to(cd)
            b = None if bias is None else bias[lo:lo + cols].to(cd)
            g = F.linear(h, w, b).float()  # (n, c): the logits again, then softmax - one_hot, in place
            g.sub_(lse[:, None]).exp_()
            inside = (targets >= lo) & (targets < lo + w.shape[0])  # no host sync: a masked scatter
            g.scatter_add_(1, (targets - lo).clamp(0, w.shape[0] - 1)[:, None], inside.to(g.dtype).neg()[:, None])
            g.mul_(coeff)
            if need_b:
                grad_b[lo:lo + cols] = g.sum(0)
            g = g.to(cd)
            if need_w and grad_w.dtype == cd:
                torch.mm(g.t(), h, out=grad_w[lo:lo + cols])  # one product over all positions, like the model
            elif need_w:
                grad_w[lo:lo + cols] = g.t() @ h
            if need_h:
                grad_h += (g @ w).float()
            del g
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, grad_b, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *,
                    config: ChunkedLossConfig = ChunkedLossConfig(), shift_labels: torch.Tensor | None = None,
                    num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """The causal-LM loss of final hidden states ``(B, T, H)`` through ``head`` (a linear layer) against
    ``labels`` ``(B, T)`` (position t predicts label t+1; or ``shift_labels``, already aligned), chunked."""
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"chunked loss: the head must be a linear layer with a (vocab, {hidden.shape[-1]}) "
                         f"weight, got {type(head).__name__} with weight "
                         f"{None if weight is None else tuple(weight.shape)}; a sharded head (ZeRO-3) must be "
                         "gathered: mark it persistent or leave the loss unchunked")
    if shift_labels is None:
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(f"chunked loss: labels {tuple(labels.shape)} must match the tokens "
                             f"{tuple(hidden.shape[:-1])}")
        shift_labels = F.pad(labels[..., 1:], (0, 1), value=config.ignore_index)
    flat = shift_labels.reshape(-1).to(hidden.device)  # (N,)
    counted = flat != config.ignore_index
    if hidden.device.type == "cpu":  # on an accelerator the check would wait for the device: gather asserts there
        bad = counted & ((flat < 0) | (flat >= weight.shape[0]))
        if bad.any():
            raise ValueError(f"chunked loss: labels must be token ids below {weight.shape[0]} or "
                             f"{config.ignore_index} (ignored), got {flat[bad][0].item()}")
    divisor = counted.sum() if num_items_in_batch is None else num_items_in_batch
    weights = counted.float() / torch.as_tensor(divisor, dtype=torch.float32, device=hidden.device)  # 0/0: nan,
    targets = torch.where(counted, flat, torch.zeros_like(flat))  # as F.cross_entropy gives with nothing counted
    return ChunkedLMLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets, weights,
                               config.max_chunk_bytes)


def chunk_lm_loss(model: nn.Module, config: ChunkedLossConfig = ChunkedLossConfig()) -> nn.Module:
    """Make ``model`` (a Hugging Face causal LM) compute its loss chunk by chunk when called with ``labels``
    ([Note: chunked loss]); called without labels it runs as before. With labels the output's ``logits`` is
    ``None``: not building them is the point. In place; returns ``model``. :func:`unchunk_lm_loss` undoes it."""
    if hasattr(model, _MARK):
        raise ValueError("chunk_lm_loss: the model's loss is already chunked")
    for name in ("get_decoder", "get_output_embeddings"):
        if not callable(getattr(model, name, None)):
            raise ValueError(f"chunk_lm_loss needs a Hugging Face causal LM (with {name}()), "
                             f"got {type(model).__name__}")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"chunk_lm_loss: the output head must be an nn.Linear, got {type(head).__name__}")
    cfg = getattr(model, "config", None)
    for key in _UNSUPPORTED:
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            raise ValueError(f"chunk_lm_loss: this model transforms its logits ({key}={getattr(cfg, key)}), which "
                             "the chunked loss does not reproduce; leave its loss unchunked")
    if "forward" in model.__dict__:
        raise ValueError("chunk_lm_loss: the model's forward is already replaced on the instance; apply "
                         "chunk_lm_loss to the model as its class defines it")
    signature = inspect.signature(type(model).forward)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        bound.pop(next(iter(signature.parameters)))  # self
        extra = dict(bound.pop(var_kw, {})) if var_kw else {}
        labels = bound.pop("labels", None)
        if labels is None:
            return type(self).forward(self, *args, **kwargs)
        for unused in ("logits_to_keep", "return_dict"):
            bound.pop(unused, None)
        shift_labels = extra.pop("shift_labels", None)
        num_items = extra.pop("num_items_in_batch", None)
        out = self.get_decoder()(**bound, **extra)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        loss = chunked_lm_loss(hidden, self.get_output_embeddings(), labels, config=config,
                               shift_labels=shift_labels, num_items_in_batch=num_items)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    setattr(model, _MARK, True)
    model.forward = types.MethodType(forward, model)  # deepcopy rebinds it to the copy
    return model


def unchunk_lm_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`chunk_lm_loss`."""
    if not hasattr(model, _MARK):
        raise ValueError("unchunk_lm_loss: the model's loss is not chunked")
    delattr(model, _MARK)
    del model.forward
    return model


def is_chunked(model: nn.Module) -> bool:
    return hasattr(model, _MARK)
