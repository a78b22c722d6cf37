"""WarmupLR, WarmupDecayLR, WarmupCosineLR against DeepSpeed's formulas, and state_dict round trips."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from zspeed.train.config import load_config
from zspeed.train.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_lr_scheduler


def optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lr_trace(sched: LRScheduler, steps: int) -> list[list[float]]:
    """The lrs in effect for optimizer steps 1..steps (torch order: optimizer.step, then scheduler.step)."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in sched.optimizer.param_groups])
        sched.optimizer.step()
        sched.step()
    return out


# DeepSpeed's formulas, written out independently, as functions of the step index t.
def ds_warmup(t, n, kind):
    n = max(2, n)
    if t >= n:
        return 1.0
    return math.log(t + 1) / math.log(n) if kind == "log" else t / n


def ds_decay(t, n, total, kind):
    return ds_warmup(t, n, kind) if t < max(2, n) else max(0.0, (total - t) / max(1, total - max(2, n)))


def ds_cosine(t, n, total, lo, cos_min, kind):
    if t < max(2, n):
        return lo + (1 - lo) * ds_warmup(t, n, kind)
    p = min(1.0, (t - max(2, n) + 1) / (total - max(2, n)))
    return cos_min + (1 - cos_min) * (1 + math.cos(math.pi * p)) / 2


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    s = WarmupLR(optimizer(0.5), warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=kind)
    trace = lr_trace(s, 15)
    for t, (lr,) in enumerate(trace):
        assert lr == pytest.approx(0.01 + 0.09 * ds_warmup(t, 10, kind)), t
    assert trace[0] == [0.01] and trace[10] == trace[14] == [pytest.approx(0.1)]
    if kind == "log":
        assert trace[4][0] == pytest.approx(0.01 + 0.09 * math.log(5) / math.log(10))
    else:
        assert trace[4][0] == pytest.approx(0.01 + 0.09 * 0.4)


def test_warmup_lr_defaults_to_the_optimizers_lr_and_at_least_two_steps():
    s = WarmupLR(optimizer(0.2, 0.4), warmup_num_steps=0, warmup_type="linear")
    assert lr_trace(s, 3) == [[0.0, 0.0], [0.1, 0.2], [0.2, 0.4]]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    s = WarmupDecayLR(optimizer(1.0), total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=1.0,
                      warmup_num_steps=5, warmup_type=kind)
    trace = [lr for (lr,) in lr_trace(s, 25)]
    for t, lr in enumerate(trace):
        assert lr == pytest.approx(ds_decay(t, 5, 20, kind)), t
    assert trace[5] == pytest.approx(1.0) and trace[11] == pytest.approx(9 / 15)
    assert trace[20] == trace[24] == 0.0


def test_warmup_cosine_lr_known_values():
    s = WarmupCosineLR(optimizer(2.0), total_num_steps=10, warmup_num_steps=2, warmup_min_ratio=0.0,
                       cos_min_ratio=0.0, warmup_type="linear")
    trace = [lr for (lr,) in lr_trace(s, 12)]
    expected = {0: 0.0, 1: 1.0, 2: 2 * 0.9619397662556434, 6: 2 * 0.30865828381745514, 9: 0.0, 11: 0.0}
    for t, lr in expected.items():
        assert trace[t] == pytest.approx(lr, abs=1e-12), t


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_scales_each_group(kind):
    s = WarmupCosineLR(optimizer(1e-3, 5e-4), total_num_steps=30, warmup_num_steps=8, warmup_min_ratio=0.1,
                       cos_min_ratio=0.05, warmup_type=kind)
    for t, (a, b) in enumerate(lr_trace(s, 40)):
        r = ds_cosine(t, 8, 30, 0.1, 0.05, kind)
        assert (a, b) == (pytest.approx(1e-3 * r), pytest.approx(5e-4 * r)), t
    assert s.get_last_lr()[0] == pytest.approx(1e-3 * 0.05)  # held at cos_min_ratio past the end


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=6),
    lambda o: WarmupDecayLR(o, total_num_steps=15, warmup_num_steps=4, warmup_type="linear"),
    lambda o: WarmupCosineLR(o, total_num_steps=15, warmup_num_steps=4, warmup_min_ratio=0.2),
])
def test_state_dict_round_trip(make):
    a = make(optimizer(0.3, 0.1))
    lr_trace(a, 7)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-serialisable, for checkpoint metadata
    b = make(optimizer(0.3, 0.1))
    b.optimizer.load_state_dict(a.optimizer.state_dict())  # torch order: scheduler built first, then loads
    b.load_state_dict(state)
    assert b.last_batch_iteration == a.last_batch_iteration == 7
    assert lr_trace(a, 10) == lr_trace(b, 10)


def test_resume_from_deepspeed_state_and_from_last_batch_iteration():
    fresh = WarmupLR(optimizer(1.0), warmup_num_steps=10, warmup_type="linear")
    expected = lr_trace(fresh, 10)
    resumed = WarmupLR(optimizer(1.0), warmup_num_steps=10, warmup_type="linear")
    resumed.load_state_dict({"last_batch_iteration": 4})  # DeepSpeed's scheduler state
    assert lr_trace(resumed, 5) == expected[5:]
    from_config = WarmupLR(optimizer(1.0), warmup_num_steps=10, warmup_type="linear", last_batch_iteration=4)
    assert lr_trace(from_config, 5) == expected[5:]


def test_factory_from_parsed_config():
    def sched(s):
        return load_config({"train_batch_size": 1, "scheduler": s}, world_size=1).scheduler
    opt = optimizer(0.01)
    s = build_lr_scheduler(opt, sched({"type": "WarmupDecayLR", "params": {
        "total_num_steps": "100", "warmup_max_lr": 0.02, "warmup_num_steps": 10, "warmup_type": "linear"}}))
    assert isinstance(s, WarmupDecayLR) and isinstance(s, LRScheduler)
    assert [lr for (lr,) in lr_trace(s, 12)][10] == pytest.approx(0.02)
    s = build_lr_scheduler(optimizer(0.01), sched({"type": "WarmupCosineLR", "params": {"total_num_steps": 50}}))
    assert isinstance(s, WarmupCosineLR) and s.cos_min_ratio == 0.0001 and s.warmup_num_steps == 1000
    s = build_lr_scheduler(optimizer(0.01), sched({"type": "WarmupLR"}))
    assert isinstance(s, WarmupLR) and s.max_lrs == [0.01] and s.warmup_type == "log"
    assert build_lr_scheduler(opt, None) is None


def test_per_group_lists_must_match_groups():
    with pytest.raises(ValueError, match="2 parameter groups"):
        WarmupLR(optimizer(0.1, 0.2), warmup_min_lr=[0.0, 0.0, 0.0])
