"""The offloaded optimizer's host update for torch's fused CPU Adam / AdamW, walked in cache-sized chunks.

:class:`~zspeed.train.offload.OptimizerOffload` calls :func:`fused_adam_plan`
for each group's update; when it returns a plan, :func:`chunked_adam_update`
does what ``master.grad = grad × scale; optimizer.step(); out.copy_(master)``
would, bit for bit, without allocating and in one pass over memory.

[Note: the chunked host update]
The plain update streams every array through memory several times: the 16-bit
gradient is cast into a fresh fp32 tensor (its page faults cost more than the
AdamW step: for 50M elements on 2 threads ~45 ms against ~32 ms), the scale
multiplies it in place, the fused step reads it back with the master and both
moments, and the 16-bit output cast reads the master once more. Here the group
is walked in chunks of :data:`CHUNK_NUMEL` elements (1M: each thread's slices
fit its L2), and each chunk goes through all four stages while it is in cache:
cast the gradient slice into one persistent fp32 scratch chunk
(:class:`Scratch`), ``mul_`` it by the scale, ``torch._fused_adam(w)_`` on
views of the master and moments, cast the master slice into the 16-bit output.
Memory then sees each array once (28 bytes per element: master, exp_avg,
exp_avg_sq read and written, the 16-bit gradient read, the 16-bit output
written) and nothing is allocated per step. (Casting and scaling in one
``torch.mul(grad16, fp32_scale_tensor, out=buf)`` is exact too, but its
mixed-dtype loop is slower than the two vectorized passes.)

Why it is exact: the fused kernel is elementwise and reads ``step`` (incremented
once per update, before the chunks, as torch's ``_fused_adam`` does) and the
hyperparameters, not the tensor extent; the scale is applied by the same fp32
``mul_`` as before the step; the casts are exact or round to nearest. The one
trap is the kernel's scalar tail (the last ``numel % lanes`` elements of a
range), whose rounding differs from its vector body: a chunking by 7 elements
changes ~450 of 1M updated elements. Chunk boundaries are therefore multiples
of :data:`ALIGN`, so every element goes through the vector body or the scalar
tail exactly as it does in one whole-tensor call.

What it covers is what torch's fused CPU step does for a flat fp32 master:
Adam and AdamW (exactly those classes), ``fused=True``, betas numbers, lr a
number or a one-element tensor, amsgrad, maximize, weight decay; anything else (SGD,
AdamW8bit, a subclass, step hooks, an AMP ``grad_scale``/``found_inf``, state
torch would not have made) gets ``None`` from :func:`fused_adam_plan` and the
caller runs ``optimizer.step()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

__all__ = ["ALIGN", "CHUNK_NUMEL", "AdamPlan", "Scratch", "chunk_numel", "chunked_adam_update",
           "fused_adam_plan", "fused_adam_usable", "record_step"]

# Elements per chunk (DeepSpeed's CPU Adam uses the same 1M-element tile): on a 16-32-thread host each
# thread gets 32K-64K elements of each op on the chunk, so its slices of the fp32 gradient scratch and of
# the master (256-512 KiB) stay in its core's L2 between the four passes over them. Much smaller chunks
# pay the per-op dispatch and thread fork/join (four ops per chunk) too often, which hurts most when the
# cores are shared (a descheduled thread stalls every join); much larger ones fall out of cache.
# benchmarks/bench_cpu_adam.py measures it (2 threads, 50M elements: 128K-4M within ~7%, 16M ~20% slower).
CHUNK_NUMEL = 1 << 20
# Chunk boundaries are multiples of this many elements: a cache line of fp32 holds 16 (AVX-512 lanes),
# so no chunk boundary lands inside a vector (see [Note: the chunked host update]).
ALIGN = 64


def chunk_numel() -> int:
    """:data:`CHUNK_NUMEL` rounded down to a multiple of :data:`ALIGN` (at least one ``ALIGN``)."""
    return max(ALIGN, CHUNK_NUMEL // ALIGN * ALIGN)


class Scratch:
    """One persistent fp32 buffer, grown to the largest request and reused (single-threaded use only)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def take(self, numel: int) -> torch.Tensor:
        """A 1-D fp32 view of ``numel`` elements; its contents are whatever the last user left."""
        if self._buf.numel() < numel:
            self._buf = torch.empty(0, dtype=torch.float32)  # free the old buffer before allocating the new one
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf[:numel]


@dataclass(frozen=True, slots=True)
class AdamPlan:
    """One master's fused Adam(W) step: its state tensors and the kernel's keyword arguments."""

    step: torch.Tensor  # float32 scalar on the CPU, incremented once per update
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None  # amsgrad only
    kernel: Any  # torch._fused_adam_ or torch._fused_adamw_
    hyper: dict[str, Any]  # lr, beta1, beta2, weight_decay, eps, amsgrad, maximize


def fused_adam_plan(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> AdamPlan | None:
    """The plan for ``master``'s update when :func:`chunked_adam_update` can replace ``optimizer.step()``
    exactly, else None. Initialises the state on the first step as torch's ``Adam._init_group`` does.

    ``optimizer`` may be a :func:`~zspeed.train.offload._frozen` view: the hyperparameters come from its
    own param groups, the state from the state it shares with the real optimizer."""
    group = _fused_group_of(optimizer, master)
    if group is None:
        return None
    state = optimizer.state[master]
    if len(state) == 0:
        _init_state(state, master, amsgrad=group["amsgrad"])
    if not _state_matches(state, master, amsgrad=group["amsgrad"]):
        return None
    decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        lr = lr.to("cpu")  # as torch's _fused_adam does for a device lr and CPU parameters
    return AdamPlan(step=state["step"], exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"],
                    max_exp_avg_sq=state.get("max_exp_avg_sq") if group["amsgrad"] else None,
                    kernel=torch._fused_adamw_ if decoupled else torch._fused_adam_,
                    hyper={"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"],
                           "eps": group["eps"], "amsgrad": group["amsgrad"], "maximize": group["maximize"]})


def fused_adam_usable(optimizer: torch.optim.Optimizer, master: torch.Tensor, *, streamed: bool = False) -> bool:
    """Whether :func:`fused_adam_plan` will give ``master`` a plan (before its state exists); with
    ``streamed``, also whether the plan suits :class:`~zspeed.train.streamed_adam.StreamedAdam` (no amsgrad)."""
    group = _fused_group_of(optimizer, master)
    return group is not None and not (streamed and group["amsgrad"])


def _fused_group_of(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any] | None:
    """``master``'s param group when torch's fused Adam(W) kernel can step it as :func:`chunked_adam_update`
    does, else None."""
    if not _fused_adam_eligible(optimizer, master):
        return None
    group = next((g for g in optimizer.param_groups if any(p is master for p in g["params"])), None)
    return group if group is not None and _fused_adam_group(group) else None


def _fused_adam_eligible(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> bool:
    """The optimizer is torch's own Adam/AdamW, nothing hooks or scales its step, the master is flat fp32."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", None))
    if any(h for h in hooks):  # step() would run them
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False  # AMP's GradScaler hands these to the kernel; not used by the offload
    return (master.device.type == "cpu" and master.dtype == torch.float32 and master.is_contiguous()
            and master.numel() > 0)


def _fused_adam_group(group: dict[str, Any]) -> bool:
    lr, (beta1, beta2) = group["lr"], group["betas"]
    return (bool(group.get("fused")) and not group.get("differentiable", False)
            and not isinstance(beta1, torch.Tensor) and not isinstance(beta2, torch.Tensor)
            and (not isinstance(lr, torch.Tensor) or lr.numel() == 1))


def _init_state(state: dict[str, Any], master: torch.Tensor, *, amsgrad: bool) -> None:
    """Torch's first-step state for a fused Adam parameter, in torch's key order."""
    state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)


def _state_matches(state: dict[str, Any], master: torch.Tensor, *, amsgrad: bool) -> bool:
    """The state is what torch's fused step would use as is (else ``optimizer.step()`` decides what to do)."""
    step = state.get("step")
    if not (isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.numel() == 1
            and step.device.type == "cpu"):
        return False
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    return all(isinstance(t := state.get(k), torch.Tensor) and t.shape == master.shape and t.dtype == master.dtype
               and t.device == master.device and t.is_contiguous() for k in names)


def chunked_adam_update(plan: AdamPlan, *, master: torch.Tensor, grad: torch.Tensor, scale: float,
                        out: torch.Tensor, scratch: Scratch,
                        into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """``master.grad = fp32(grad) × scale; optimizer.step(); out.copy_(master)``, chunk by chunk
    (see [Note: the chunked host update]). ``grad`` and ``out`` have the master's number of elements,
    in any float dtype.

    With ``into`` (a master, exp_avg and exp_avg_sq of the same shapes, not amsgrad) the step is written
    there instead, and the master, its state and the step count are left as they were: each chunk is
    copied over, then stepped in place while in cache, so ``into`` ends bit for bit what the master and
    moments would have become (see [Note: speculative update] in :mod:`zspeed.train.offload`)."""
    n = master.numel()
    if grad.numel() != n or out.numel() != n:
        raise ValueError(f"chunked_adam_update: master has {n} elements, its gradient {grad.numel()} "
                         f"and its output buffer {out.numel()}; they must be the same chunk of the group")
    if into is not None and (plan.max_exp_avg_sq is not None or any(t.numel() != n for t in into)):
        raise ValueError("chunked_adam_update: `into` needs three arrays of the master's size and no amsgrad")
    chunk = chunk_numel()
    flat = [t.view(-1) for t in (master, plan.exp_avg, plan.exp_avg_sq)]
    dest = [t.view(-1) for t in into] if into is not None else flat
    amsgrad = plan.max_exp_avg_sq.view(-1) if plan.max_exp_avg_sq is not None else None
    g, o = grad.view(-1), out.view(-1)
    buf = scratch.take(min(chunk, n))
    with torch.no_grad():
        if into is None:
            step = plan.step
            step.add_(1)  # once per update, before the kernel reads it (torch: _foreach_add_(steps, 1))
        else:
            step = plan.step + 1  # what the step count will be if this update is kept
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            p, m, v = (t[lo:hi] for t in dest)
            if into is not None:
                for d, src in zip((p, m, v), flat):
                    d.copy_(src[lo:hi])
            plan.kernel([p], [_scaled(g[lo:hi], scale, buf[:hi - lo])], [m], [v],
                        [amsgrad[lo:hi]] if amsgrad is not None else [], [step], **plan.hyper)
            o[lo:hi].copy_(p)


def _scaled(grad: torch.Tensor, scale: float, buf: torch.Tensor) -> torch.Tensor:
    """``fp32(grad) × scale`` (the same fp32 ``mul_`` as the whole-tensor path), in ``buf`` unless
    ``grad`` is already fp32 and unscaled."""
    if grad.dtype == torch.float32 and scale == 1.0:
        return grad
    buf.copy_(grad)
    if scale != 1.0:
        buf.mul_(scale)
    return buf


def record_step(optimizer: torch.optim.Optimizer) -> None:
    """Leave the trace ``optimizer.step()`` would have left: torch's LR schedulers wrap the step of the
    optimizer they drive to set ``_opt_called``, and warn on their first step if it is unset. A
    :func:`~zspeed.train.offload._frozen` view's step is not wrapped, so it records nothing, as before."""
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]
