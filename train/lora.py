"""LoRA fine-tuning for ``ztrain``, through peft: a transform on the model, applied before the engine wraps it.

* :class:`LoraSpec` is the ``--lora-*`` flags, validated at construction;
  :func:`check_targets` proves every target pattern names a ``Linear`` of the
  model, from a meta-device build (no weights), before any work.
* :func:`apply_lora` wraps the model with peft's ``get_peft_model``: the base
  weights become ``requires_grad=False``, so the engine keeps them in frozen
  flat groups (no gradients, no optimizer state) and trains only the adapters.
* :func:`merged_state_dict` turns the engine's gathered state (peft names)
  into a plain model's state dict with peft's ``merge_and_unload``, after
  saving the adapter alone with peft's ``save_pretrained``.

[Note: LoRA checkpoints]
Checkpoints are the engine's usual ones (frozen base included, so they stay
self-contained and reshardable); ``ztrain`` adds the spec to the client state.
A resume checks the spec before any work (:func:`check_resume`): other LoRA
flags would silently change the tensors' shapes or scale, so they are refused
by name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn

__all__ = ["LoraError", "LoraSpec", "DEFAULT_TARGETS", "ADAPTER_DIR", "linear_names", "check_targets",
           "meta_model", "apply_lora", "lora_parameter_shapes", "merged_state_dict", "check_resume"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_DIR = "adapter"


class LoraError(ValueError):
    """Bad LoRA flags, or a resume whose LoRA flags differ from the checkpoint's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """The adapter: rank ``r``, scale ``alpha / r``, dropout on the adapter input, and target module names.

    A target matches a module whose full name is the target or ends with ``"." + target``
    (peft's rule for a list of names), e.g. ``q_proj`` or ``self_attn.q_proj``.
    """

    r: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.r < 1:
            raise LoraError(f"--lora-r must be >= 1, got {self.r}")
        if not self.alpha > 0:
            raise LoraError(f"--lora-alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise LoraError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.targets or any(not t for t in self.targets):
            raise LoraError(f"--lora-targets must be a comma-separated list of module names, got "
                            f"{','.join(self.targets)!r}")

    @classmethod
    def from_flags(cls, *, r: int, alpha: float | None, dropout: float | None, targets: str | None) -> "LoraSpec":
        names = tuple(t.strip() for t in targets.split(",")) if targets is not None else DEFAULT_TARGETS
        return cls(r=r, alpha=16.0 if alpha is None else alpha, dropout=0.0 if dropout is None else dropout,
                   targets=names)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), targets=list(self.targets))

    def flags(self) -> str:
        return (f"--lora-r {self.r} --lora-alpha {self.alpha:g} --lora-dropout {self.dropout:g} "
                f"--lora-targets {','.join(self.targets)}")

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.targets), bias="none", task_type="CAUSAL_LM")


# -- checks before any work ---------------------------------------------------------------------

def linear_names(model: nn.Module) -> list[str]:
    """Full names of the model's ``nn.Linear`` modules, in registration order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def check_targets(spec: LoraSpec, model: nn.Module, *, model_name: str = "the model") -> None:
    """Every target must name at least one ``Linear`` of ``model`` (built on the meta device is enough).

    Raises:
        LoraError: naming the first target that matches nothing, and a few real ``Linear`` names.
    """
    names = linear_names(model)
    for target in spec.targets:
        if not any(_matches(n, target) for n in names):
            short = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
            raise LoraError(f"--lora-targets: no Linear module of {model_name} matches {target!r}; its Linear "
                            f"modules are named {', '.join(short[:8])} (e.g. {names[0] if names else 'none'})")


def meta_model(model_cfg) -> nn.Module:
    """The model of ``model_cfg`` on the meta device (names and shapes, no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_cfg)


def lora_parameter_shapes(model_cfg, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape of the LoRA-wrapped model, from the config alone (meta device)."""
    with torch.device("meta"):
        model = apply_lora(meta_model(model_cfg), spec, seed=0)
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def check_resume(saved: Mapping[str, Any] | None, spec: LoraSpec | None, *, where: str) -> None:
    """A resumed run must use the checkpoint's LoRA flags (none if it had none); see [Note: LoRA checkpoints]."""
    mine = spec.to_dict() if spec is not None else None
    if saved == mine:
        return
    had = LoraSpec(**dict(saved, targets=tuple(saved["targets"]))).flags() if saved else "no LoRA"
    asked = spec.flags() if spec is not None else "no LoRA"
    raise LoraError(f"--resume: {where} was trained with {had}, but this run asks for {asked}; resume with the "
                    "checkpoint's LoRA flags, or start a new --out")


# -- the transform --------------------------------------------------------------------------------

def apply_lora(model: nn.Module, spec: LoraSpec, *, seed: int) -> nn.Module:
    """``model`` wrapped by peft's ``get_peft_model``: only the adapters require grad.

    The adapters' random initialisation (``lora_A``; ``lora_B`` starts at zero) is seeded, so every
    rank builds the same values.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, spec.peft_config())


def merged_state_dict(full_state: Mapping[str, torch.Tensor], base: nn.Module, spec: LoraSpec, *,
                      adapter_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict with the trained adapters merged into the base weights.

    Args:
        full_state: the LoRA-wrapped model's whole state dict (``engine.full_state_dict()``; peft names).
        base: a fresh, unwrapped model of the same architecture (its values are replaced).
        spec: the adapters ``full_state`` was trained with.
        adapter_dir: where to save the adapter alone (peft's ``save_pretrained``), or None.
    """
    model = apply_lora(base, spec, seed=0)
    model.load_state_dict(dict(full_state), strict=True)
    if adapter_dir is not None:
        model.save_pretrained(str(adapter_dir))
    return model.merge_and_unload().state_dict(keep_vars=True)  # tied names keep one tensor
