"""Shared pieces of the engine tests: tiny models, data, the engine run and the plain-PyTorch reference.

The data of optimizer step ``s`` is ``world × accumulation`` micro-batches; rank
``r`` trains on micro-batch ``k·world + r`` at micro-step ``k``. The reference
runs every micro-batch of the step in one process and averages the gradients
(the mean over the global batch), then steps a torch optimizer. For 16-bit
runs the reference also keeps fp32 master weights and computes in 16 bits.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from zspeed.core.comm import ReduceOp, all_reduce
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine

VOCAB, SEQ, MICRO_BS = 128, 12, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d: int = 24, d_out: int = 4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(cfg)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiny_llama() if kind == "llama" else MLP()


def micro_batch(kind: str, step: int, index: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step * 1009 + index)
    if kind == "llama":
        ids = torch.randint(0, VOCAB, (MICRO_BS, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids}
    return {"x": torch.randn(MICRO_BS, 8, generator=g), "y": torch.randn(MICRO_BS, 4, generator=g)}


def loss_of(kind: str, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "llama":
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    out = model(batch["x"])
    return F.mse_loss(out.float(), batch["y"])


@dataclass(frozen=True)
class Case:
    kind: str = "mlp"
    stage: int = 0
    precision: str = "fp32"
    gas: int = 1
    steps: int = 5
    clip: float = 0.0
    lr: float = 1e-2  # large enough that 5 Adam steps move parameters far beyond rounding noise
    optimizer: str = "AdamW"  # or "SGD": linear in the gradient, so clipping shows in the weights
    act_ckpt: bool = False
    block_classes: tuple | None = None
    bucket: int = 300  # reduce_bucket_size (elements): several units at stages 0-2

    def ds_config(self, world: int) -> dict:
        cfg = {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": self.gas,
               "optimizer": {"type": self.optimizer, "params": {"lr": self.lr, "weight_decay": 0.01}},
               "gradient_clipping": self.clip, "steps_per_print": 1,
               "zero_optimization": {"stage": self.stage, "reduce_bucket_size": self.bucket,
                                     "stage3_param_persistence_threshold": 0,
                                     "stage3_prefetch_bucket_size": 2000}}
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.precision == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
        if self.act_ckpt:
            cfg["activation_checkpointing"] = {}
        return cfg

    def reference_key(self) -> "Case":
        return replace(self, stage=0, act_ckpt=False, block_classes=None, bucket=0)


def build_engine(topo, case: Case, seed: int = 0) -> ZeroEngine:
    config = load_config(case.ds_config(topo.world_size), world_size=topo.world_size)
    return ZeroEngine(module=make_model(case.kind, seed), config=config, topo=topo,
                      block_classes=case.block_classes)


def run_engine(topo, case: Case) -> dict:
    """Train; return the per-step global mean loss, the final fp32 master weights and grad norms."""
    engine = build_engine(topo, case)
    losses, norms = [], []
    for step in range(case.steps):
        total = torch.zeros(1)
        for k in range(case.gas):
            batch = micro_batch(case.kind, step, k * topo.world_size + topo.rank)
            loss = loss_of(case.kind, engine, batch)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        all_reduce(total, topo=topo, op=ReduceOp.AVG)
        losses.append(total.item() / case.gas)
        norms.append(engine.last_outcome.grad_norm)
    return {"losses": losses, "params": engine.full_state_dict(master=True), "norms": norms}


def run_reference(case: Case, world: int) -> dict:
    """Plain PyTorch: one process, fp32 masters, the global batch's mean gradient."""
    model = make_model(case.kind)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    dtype = DTYPES[case.precision]
    model.to(dtype)
    params = dict(model.named_parameters())
    opt_cls = torch.optim.AdamW if case.optimizer == "AdamW" else torch.optim.SGD
    opt = opt_cls(list(masters.values()), lr=case.lr, weight_decay=0.01)
    n_micro = world * case.gas
    losses, norms = [], []
    for step in range(case.steps):
        grads = {n: torch.zeros_like(m) for n, m in masters.items()}
        total = 0.0
        for i in range(n_micro):
            batch = _cast(micro_batch(case.kind, step, i), dtype)
            loss = loss_of(case.kind, model, batch)
            (loss.float() / n_micro).backward()
            total += loss.item()
            for n, p in params.items():
                grads[n] += p.grad.float()
                p.grad = None
        for n, m in masters.items():
            m.grad = grads[n]
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), case.clip or float("inf"))))
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        losses.append(total / n_micro)
    sd = {k: v.float() for k, v in model.state_dict().items()}
    sd.update({n: m.detach() for n, m in masters.items()})
    for name, t in model.state_dict(keep_vars=True).items():  # tied weights appear under every name
        for n, p in params.items():
            if t is p:
                sd[name] = masters[n].detach()
    return {"losses": losses, "params": sd, "norms": norms, "init": init}


def _cast(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's input in the compute dtype, as the engine casts it (targets stay fp32)."""
    return {k: v.to(dtype) if k == "x" else v for k, v in batch.items()}


@dataclass(frozen=True)
class Tolerance:
    """loss: relative, per step. param_abs: largest element difference (None: not checked).
    param_rel: ‖got − want‖ / ‖want − initial‖ over all parameters: the error relative to how
    far training moved them (bf16 noise flips Adam's sign-like update of near-zero gradients,
    so elementwise checks say little there). norm: relative error of the global grad norm."""

    loss: float
    param_abs: float | None
    param_rel: float
    norm: float


TOLERANCE = {"fp32": Tolerance(loss=1e-5, param_abs=5e-5, param_rel=1e-3, norm=1e-4),
             "bf16": Tolerance(loss=5e-3, param_abs=None, param_rel=0.15, norm=3e-2)}


def compare(got: dict, want: dict, *, tol: Tolerance, label: str) -> list[str]:
    """Mismatches between an engine run and the reference, as readable lines (empty: they agree)."""
    errors = []
    for s, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        if not abs(a - b) <= tol.loss * max(1.0, abs(b)):
            errors.append(f"{label}: step {s} loss {a:.6f} vs reference {b:.6f}")
    for s, (a, b) in enumerate(zip(got["norms"], want["norms"])):
        if not abs(a - b) <= tol.norm * abs(b):
            errors.append(f"{label}: step {s} grad norm {a:.6f} vs reference {b:.6f}")
    if got["params"].keys() != want["params"].keys():
        return errors + [f"{label}: state dict keys differ: {sorted(got['params'].keys() ^ want['params'].keys())}"]
    err_sq = moved_sq = 0.0
    for name, w in want["params"].items():
        g, w0 = got["params"][name].float(), want["init"][name].float()
        diff = (g - w.float()).abs().max().item()
        if tol.param_abs is not None and not diff <= tol.param_abs:
            errors.append(f"{label}: param {name} differs by {diff:.3g} (tol {tol.param_abs})")
        err_sq += (g - w).square().sum().item()
        moved_sq += (w - w0).square().sum().item()
    rel = (err_sq / moved_sq) ** 0.5 if moved_sq else float("inf")
    if not rel <= tol.param_rel:
        errors.append(f"{label}: params off by {rel:.3g} of their movement (tol {tol.param_rel})")
    return errors


def cached_reference(cache: dict, case: Case, world: int) -> dict:
    key = case.reference_key()
    if key not in cache:
        cache[key] = copy.deepcopy(run_reference(case, world))
    return cache[key]
