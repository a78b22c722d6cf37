"""Loss scalers, step by step against DeepSpeed's rule, and the inf/NaN gradient check."""
from __future__ import annotations

import pytest
import torch

from zspeed.train.config import load_config
from zspeed.train.loss_scaler import (
    DynamicLossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    grads_have_inf_or_nan,
    make_loss_scaler,
)

O, G = True, False  # overflow, good step


def run(scaler, steps):
    """Feed overflow flags; return (applied, scale, hysteresis_left, skipped) after each."""
    out = []
    for overflow in steps:
        applied = scaler.update(overflow)
        out.append((applied, scaler.loss_scale, scaler.hysteresis_left, scaler.skipped_steps))
    return out


def test_hysteresis_then_halving_then_window_doubling():
    s = DynamicLossScaler(init_scale=8.0, scale_window=3, hysteresis=2, min_scale=1.0, raise_at_min_scale=False)
    assert (s.loss_scale, s.hysteresis_left, s.skipped_steps) == (8.0, 2, 0)
    expected = [
        (False, 8.0, 1, 1),  # iter 0: overflow spends hysteresis, scale kept, step skipped
        (False, 4.0, 1, 2),  # iter 1: hysteresis exhausted -> halve
        (True, 4.0, 1, 2),   # iter 2: 1 good step since the overflow
        (True, 4.0, 1, 2),   # iter 3: 2 good steps
        (True, 8.0, 2, 2),   # iter 4: 3 good steps = window -> double, hysteresis refilled
        (False, 8.0, 1, 3),  # iter 5: overflow spends hysteresis again
        (True, 8.0, 1, 3),   # iter 6: good step does not refill (not consecutive_hysteresis)
        (False, 4.0, 1, 4),  # iter 7: halve
        (False, 2.0, 1, 5),  # iter 8
        (False, 1.0, 1, 6),  # iter 9: reaches min
        (False, 1.0, 1, 7),  # iter 10: never below min
        (True, 1.0, 1, 7),
        (True, 1.0, 1, 7),
        (True, 2.0, 2, 7),   # window after the last overflow
    ]
    assert run(s, [O, O, G, G, G, O, G, O, O, O, O, G, G, G]) == expected


def test_doubles_every_window_without_overflow():
    s = DynamicLossScaler(init_scale=1.0, scale_window=4, hysteresis=1)
    scales = [s.loss_scale for _ in range(12) if s.update(False)]
    assert scales == [1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8]


def test_hysteresis_one_halves_at_once():
    s = DynamicLossScaler(init_scale=1024.0, scale_window=100, hysteresis=1)
    assert [r[1] for r in run(s, [O, O, G, O])] == [512.0, 256.0, 256.0, 128.0]


def test_consecutive_hysteresis_refills_after_every_good_step():
    plain = DynamicLossScaler(init_scale=64.0, scale_window=100, hysteresis=2)
    consecutive = DynamicLossScaler(init_scale=64.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    steps = [O, G, O, O]
    assert [r[1:3] for r in run(plain, steps)] == [(64.0, 1), (64.0, 1), (32.0, 1), (16.0, 1)]
    assert [r[1:3] for r in run(consecutive, steps)] == [(64.0, 1), (64.0, 2), (64.0, 1), (32.0, 1)]


def test_halving_stops_at_min_scale_that_is_not_a_power_of_two():
    s = DynamicLossScaler(init_scale=4.0, scale_window=10, hysteresis=1, min_scale=1.5, raise_at_min_scale=False)
    assert [r[1] for r in run(s, [O, O, O])] == [2.0, 1.5, 1.5]


def test_overflow_at_min_scale_raises_like_deepspeed():
    s = DynamicLossScaler(init_scale=2.0, scale_window=10, hysteresis=1, min_scale=1.0)
    s.update(True)
    assert s.loss_scale == 1.0
    with pytest.raises(LossScaleUnderflowError, match="minimum loss scale 1"):
        s.update(True)


def test_dynamic_state_dict_round_trip_continues_identically():
    a = DynamicLossScaler(init_scale=16.0, scale_window=3, hysteresis=2)
    run(a, [O, G, O, G])
    b = DynamicLossScaler(init_scale=1.0, scale_window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    tail = [G, G, O, G, G, G, O, O]
    assert run(a, tail) == run(b, tail)
    with pytest.raises(ValueError, match="static"):
        StaticLossScaler(1.0).load_state_dict(a.state_dict())


def test_static_scaler_skips_overflows_but_keeps_its_scale():
    s = StaticLossScaler(128.0)
    assert [s.update(f) for f in (G, O, G, O)] == [True, False, True, False]
    assert s.loss_scale == 128.0 and s.skipped_steps == 2
    t = StaticLossScaler(1.0)
    t.load_state_dict(s.state_dict())
    assert (t.loss_scale, t.skipped_steps) == (128.0, 2)


def test_make_loss_scaler_from_config():
    def fp16(**kw):
        return load_config({"train_batch_size": 1, "fp16": kw}, world_size=1).fp16
    assert make_loss_scaler(fp16(enabled=False)) is None
    static = make_loss_scaler(fp16(enabled=True, loss_scale=256))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0
    dyn = make_loss_scaler(fp16(enabled=True, initial_scale_power=5, loss_scale_window=2, hysteresis=1,
                                min_loss_scale=4))
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.loss_scale, dyn.scale_window, dyn.hysteresis, dyn.min_scale) == (32.0, 2, 1, 4.0)
    assert make_loss_scaler(fp16(enabled=True)).loss_scale == 2.0**16


# -- the inf / NaN check ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_detects_inf_and_nan_anywhere(dtype, bad):
    clean = [torch.full((7,), 3.0, dtype=dtype), torch.arange(5, dtype=dtype)]
    assert not grads_have_inf_or_nan(clean)
    dirty = torch.full((4, 5), 100.0, dtype=dtype)
    dirty[2, 1] = bad  # not the largest element: NaN must still propagate
    assert grads_have_inf_or_nan([*clean, None, dirty])


def test_large_finite_gradients_are_not_overflow():
    assert not grads_have_inf_or_nan([torch.full((10_000,), 3e38)])  # a sum would overflow; a max does not


def test_no_gradients_is_no_overflow():
    assert not grads_have_inf_or_nan([])
    assert not grads_have_inf_or_nan([None, torch.empty(0)])
    devices = []
    assert not grads_have_inf_or_nan([], reduce_flag=lambda f: devices.append(f.device) or torch.zeros(1),
                                     device=torch.device("meta"))
    assert devices == [torch.device("meta")]  # a rank without gradients still joins the reduction


def test_reduce_flag_hook_combines_ranks():
    seen = []

    def other_rank_overflowed(flag):  # in-place, like dist.all_reduce(flag, op=MAX)
        seen.append(flag.item())
        flag.fill_(1.0)

    assert grads_have_inf_or_nan([torch.ones(3)], reduce_flag=other_rank_overflowed)
    assert seen == [0.0]
    assert grads_have_inf_or_nan([torch.tensor([float("nan")])], reduce_flag=lambda f: seen.append(f.item()))
    assert seen[-1] == 1.0
    assert not grads_have_inf_or_nan([torch.ones(3)], reduce_flag=lambda f: torch.zeros(1))
    assert grads_have_inf_or_nan([torch.ones(3)], reduce_flag=lambda f: torch.ones(1))  # returned, not in place
