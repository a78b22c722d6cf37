"""The same gradients from fewer saved activations: a transform on a Hugging Face decoder.

A decoder layer's backward keeps more than it needs. Per token and layer of a Llama-shaped model, each RMSNorm
keeps an fp32 copy of its input and its normalised output (12 bytes per channel in a bf16 model, where the input
itself is 2), and the gated MLP keeps ``act(gate)`` and ``act(gate) * up`` beside ``gate`` and ``up`` (four
vectors of the MLP's width where two determine the rest). :func:`lean_activations` makes these modules keep only
what determines the rest and recompute the remainder, elementwise, in backward.

[Note: lean activations] Two replacements, each on one module instance (its ``forward``; the class, the
parameters, their names and every module hook stay as they were):

* **norms**: ``LeanNorm`` is one autograd node over the norm's input and weight. Forward runs the norm's
  arithmetic without recording it; backward runs it again with recording on and differentiates that graph
  (``torch.autograd.grad``). Kept: the input (in its own dtype) and the weight.
* **gated MLPs** (``down(act(gate(x)) * up(x))``): ``GatedProduct`` is one node over ``gate`` and ``up`` that
  keeps just those two; and while ``down`` runs, a saved-tensor hook stores its input (the product) as a recipe
  over ``gate`` and ``up``, which backward evaluates when ``down``'s backward asks for it. When another
  saved-tensor hook is already active (activation checkpointing of the layer, ``save_on_cpu``), the recipe is
  not used: that hook owns what is kept.

Backward replays the very operations forward ran, on the same inputs, so in a bf16 or fp16 model every gradient
is bit for bit the one the unchanged model gives (CPU tests: the model alone, LoRA adapters, activation
checkpointing, and the engine at ZeRO-2 and ZeRO-3 with offload, each compared exactly). Where the norm's input is
fp32 (fp32 models, autocast), that input is the residual stream itself, whose gradient autograd sums over three
uses in its own order; the lean norm hands it one sum of two, so the gradients agree up to fp32 rounding. The
recompute is elementwise: a small share of a step's time.

Per token and decoder layer of the 1.1 B Llama of benchmarks/RESULTS.md (bf16, hidden 2048, MLP 5632), what
autograd keeps falls from 91 KB to 49 KB (counted on the CPU: the norms' fp32 copies and the MLP's two products
go).

Which modules qualify is decided by running each candidate once both ways on a small random input: a module
whose output is not bit for bit its own is left as it is (Gemma's ``1 + weight`` norm, a gated MLP with extra
terms), and the report says which. The probe needs the parameters materialised: apply the transform after the
weights are loaded and before the training engine shards them (as :func:`chunk_lm_loss`).

Measured on the GPU: benchmarks/RESULTS.md, Offload, session 14.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["LeanConfig", "LeanReport", "lean_activations", "unlean_activations", "is_lean"]

_MARK = "_zspeed_lean"  # set on each module whose forward lean_activations replaced
_EPS_NAMES = ("variance_epsilon", "eps")


@dataclass(frozen=True, kw_only=True, slots=True)
class LeanConfig:
    """``norms``: RMSNorm-style modules keep only their input; ``mlp``: gated MLPs keep only ``gate`` and
    ``up``; ``probe_tokens``: rows of the random input each candidate is checked on."""

    norms: bool = True
    mlp: bool = True
    probe_tokens: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.probe_tokens, int) or self.probe_tokens < 1:
            raise ValueError(f"LeanConfig.probe_tokens must be an int >= 1, got {self.probe_tokens!r}")


@dataclass(slots=True)
class LeanReport:
    """What :func:`lean_activations` changed: module names per kind, and the candidates it left alone (name:
    why)."""

    norms: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"lean activations: {len(self.norms)} norms, {len(self.mlps)} gated MLPs"
        return text + (f"; left as they were: {self.skipped}" if self.skipped else "")


# -- the norm -----------------------------------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, operation for operation: fp32 statistics, the result cast back, then the weight."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


class _AutocastState:
    """The autocast setting forward ran under, re-entered for the recompute in backward."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type) if self.enabled else None

    def __call__(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


def _replay(ctx, fn, grad_out) -> tuple:
    """The gradients of ``fn`` at the node's saved inputs: ``fn`` run again with recording on (and the forward's
    autocast setting), then differentiated; ``None`` for inputs that need none."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
    with torch.enable_grad(), ctx.autocast():
        out = fn(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


class LeanNorm(torch.autograd.Function):
    """``_rms_norm(x, weight, eps)`` keeping ``x`` and ``weight`` only (see [Note: lean activations])."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        ctx.eps = eps
        ctx.autocast = _AutocastState(x.device.type)
        ctx.save_for_backward(x, weight)
        return _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        return *_replay(ctx, lambda x, w: _rms_norm(x, w, ctx.eps), grad_out), None


def _norm_forward(self, hidden_states):
    return LeanNorm.apply(hidden_states, self.weight, _eps_of(self))


def _eps_of(module: nn.Module) -> float:
    return float(next(getattr(module, n) for n in _EPS_NAMES if isinstance(getattr(module, n, None), (int, float))))


def _is_norm_candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and dict(module.named_parameters()).keys() == {"weight"} and not list(module.children())
            and any(isinstance(getattr(module, n, None), (int, float)) for n in _EPS_NAMES))


# -- the gated MLP ------------------------------------------------------------------------------------------------
class GatedProduct(torch.autograd.Function):
    """``act(gate) * up`` keeping ``gate`` and ``up`` only (see [Note: lean activations])."""

    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.act = act
        ctx.autocast = _AutocastState(gate.device.type)
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        return *_replay(ctx, lambda gate, up: ctx.act(gate) * up, grad_out), None


class _ProductRecipe:
    """What ``down`` keeps of its input: how to compute it again (``act(gate) * up``), and the view of it that
    was saved (``down`` may save a reshaped view), not the tensor."""

    __slots__ = ("gate", "up", "act", "autocast", "view")

    def __init__(self, gate, up, act, autocast, view=None):
        self.gate, self.up, self.act, self.autocast, self.view = gate, up, act, autocast, view

    def of(self, t: torch.Tensor) -> _ProductRecipe:
        return _ProductRecipe(self.gate, self.up, self.act, self.autocast, (t.shape, t.stride(), t.storage_offset()))

    def __call__(self) -> torch.Tensor:
        with torch.no_grad(), self.autocast():
            product = self.act(self.gate) * self.up
        return product.as_strided(*self.view)


class _ProductMatch:
    """Recognises ``product`` or a view of all of it among the tensors ``down`` saves (same storage, elements,
    dtype), without keeping a reference to it (that would keep it alive)."""

    __slots__ = ("ptr", "numel", "dtype", "device")

    def __init__(self, product: torch.Tensor):
        self.ptr, self.numel = product.untyped_storage().data_ptr(), product.numel()
        self.dtype, self.device = product.dtype, product.device

    def __call__(self, t: torch.Tensor) -> bool:
        return (t.untyped_storage().data_ptr() == self.ptr and t.numel() == self.numel and t.dtype == self.dtype
                and t.device == self.device)


def _saved_tensor_hook_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown (an old torch): assume one is, and keep the product


def _mlp_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return self.down_proj(self.act_fn(gate) * up)
    product = GatedProduct.apply(gate, up, self.act_fn)
    if _saved_tensor_hook_active():
        return self.down_proj(product)
    recipe = _ProductRecipe(gate.detach(), up.detach(), self.act_fn, _AutocastState(gate.device.type))
    is_product = _ProductMatch(product)

    def pack(t):
        return recipe.of(t) if is_product(t) else t

    def unpack(saved):
        return saved() if isinstance(saved, _ProductRecipe) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return self.down_proj(product)


def _is_mlp_candidate(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
        and callable(getattr(module, "act_fn", None))


# -- the transform ------------------------------------------------------------------------------------------------
def _probe_input(module: nn.Module, width: int, tokens: int) -> torch.Tensor | None:
    p = next(module.parameters(), None)
    if p is None or p.device.type == "meta" or p.numel() == 0:
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(tokens, width, generator=g).to(device=p.device, dtype=p.dtype)


def _agrees(module: nn.Module, lean_forward, x: torch.Tensor) -> bool:
    """Both forms on ``x`` with recording on (the lean forms differ only then), outputs compared bit for bit."""
    with torch.enable_grad():
        want = type(module).forward(module, x)
        got = lean_forward(module, x)
    return isinstance(want, torch.Tensor) and want.shape == got.shape and torch.equal(want.detach(), got.detach())


def _width(module: nn.Module, kind: str) -> int | None:
    """The input width of a candidate (the probe's); ``None`` where it cannot be read."""
    if kind == "norm":
        return module.weight.shape[0]
    width = getattr(module.gate_proj, "in_features", None)
    if isinstance(width, int):
        return width
    w = getattr(module.gate_proj, "weight", None)
    return w.shape[1] if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def lean_activations(model: nn.Module, config: LeanConfig = LeanConfig()) -> LeanReport:
    """Make ``model``'s RMSNorms and gated MLPs keep fewer activations for backward, with bit-identical
    gradients ([Note: lean activations]). In place; returns what changed. :func:`unlean_activations` undoes it.

    Raises:
        ValueError: when the model is already lean, or no candidate could be checked (parameters not
            materialised: apply after loading the weights, before sharding).
    """
    if any(hasattr(m, _MARK) for m in model.modules()):
        raise ValueError("lean_activations: the model is already lean (unlean_activations undoes it)")
    report = LeanReport()
    kinds = [("norm", _is_norm_candidate, _norm_forward, report.norms)] if config.norms else []
    kinds += [("mlp", _is_mlp_candidate, _mlp_forward, report.mlps)] if config.mlp else []
    unchecked = []
    for name, module in model.named_modules():
        for kind, is_candidate, forward, changed in kinds:
            if not is_candidate(module):
                continue
            why = _make_lean(module, kind, forward, config)
            if why is None:
                changed.append(name)
            elif why == _UNCHECKED:
                unchecked.append(name)
            else:
                report.skipped[name] = why
            break
    if unchecked and not (report.norms or report.mlps):
        raise ValueError(f"lean_activations: could not check {unchecked[:3]}: their parameters are not "
                         "materialised (meta or sharded); apply the transform after the weights are loaded and "
                         "before the engine shards them")
    report.skipped.update({name: "parameters not materialised, not checked" for name in unchecked})
    return report


_UNCHECKED = "unchecked"


def _make_lean(module: nn.Module, kind: str, forward, config: LeanConfig) -> str | None:
    """Replace ``module``'s forward by the lean ``forward`` if the probe agrees; ``None`` when replaced, else why
    not (``_UNCHECKED``: the parameters are not materialised)."""
    if "forward" in module.__dict__:
        return "its forward is already replaced on the instance"
    width = _width(module, kind)
    x = None if width is None else _probe_input(module, width, config.probe_tokens)
    if x is None:
        return _UNCHECKED
    if not _agrees(module, forward, x):
        return f"its output is not the {kind} form's, bit for bit"
    setattr(module, _MARK, kind)
    module.forward = types.MethodType(forward, module)  # deepcopy rebinds it to the copy
    return None


def unlean_activations(model: nn.Module) -> nn.Module:
    """Undo :func:`lean_activations`."""
    lean = [m for m in model.modules() if hasattr(m, _MARK)]
    if not lean:
        raise ValueError("unlean_activations: the model is not lean")
    for m in lean:
        delattr(m, _MARK)
        del m.forward
    return model


def is_lean(model: nn.Module) -> bool:
    return any(hasattr(m, _MARK) for m in model.modules())
