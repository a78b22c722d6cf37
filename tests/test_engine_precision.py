"""fp16 overflow handling and global-norm clipping, every stage, 2 gloo ranks in one spawn each."""
import math

import torch

from tests.dist_utils import run_distributed
from tests.engine_cases import (TOLERANCE, Case, build_engine, cached_reference, compare, loss_of, micro_batch,
                                run_engine)

WORLD = 2


def _train_step(engine, topo, step):
    loss = loss_of("mlp", engine, micro_batch("mlp", step, topo.rank))
    engine.backward(loss)
    return loss


def _overflow(topo, stage):
    """Step 1 gets an inf in rank 0's gradient shard only; report what each step did."""
    engine = build_engine(topo, Case(stage=stage, precision="fp16"))
    facts = {"scale0": engine.loss_scale, "rank": topo.rank}
    _train_step(engine, topo, 0)
    engine.step()
    facts["applied0"] = engine.last_outcome.applied
    before = engine.full_state_dict(master=True), engine.full_state_dict()
    lr_before = engine.get_lr()
    _train_step(engine, topo, 1)
    if topo.rank == 0:
        engine.groups[0].master.grad.view(-1)[0] = math.inf
    engine.step()
    after = engine.full_state_dict(master=True), engine.full_state_dict()
    facts.update(applied1=engine.last_outcome.applied, scale1=engine.loss_scale, skipped=engine.skipped_steps,
                 unchanged=all(torch.equal(before[i][k], after[i][k]) for i in range(2) for k in before[i]),
                 lr_unchanged=engine.get_lr() == lr_before)
    for step in (2, 3):
        _train_step(engine, topo, step)
        engine.step()
    final = engine.full_state_dict(master=True)
    facts.update(applied_later=engine.last_outcome.applied, scale_final=engine.loss_scale,
                 moved=any(not torch.equal(final[k], after[0][k]) for k in final),
                 final={k: v.tolist() for k, v in final.items()}, steps=engine.global_steps)
    return facts


def _overflow_all_stages(topo):
    return [_overflow(topo, stage) for stage in range(4)]


def test_fp16_overflow_skips_step_halves_scale_and_recovers():
    per_rank = run_distributed(_overflow_all_stages, WORLD)
    for stage in range(4):
        r0, r1 = per_rank[0][stage], per_rank[1][stage]
        for f in (r0, r1):
            assert f["applied0"], f"stage {stage} rank {f['rank']}: first step should apply"
            assert not f["applied1"], f"stage {stage} rank {f['rank']}: the overflow step was applied"
            assert f["unchanged"], f"stage {stage} rank {f['rank']}: parameters changed on a skipped step"
            assert f["lr_unchanged"], f"stage {stage}: the lr scheduler stepped on a skipped step"
            assert f["scale1"] == f["scale0"] / 2, f"stage {stage}: scale {f['scale1']} after overflow"
            assert f["skipped"] == 1 and f["steps"] == 4
            assert f["applied_later"] and f["moved"], f"stage {stage}: training did not resume"
            assert f["scale_final"] == f["scale0"], f"stage {stage}: scale did not recover ({f['scale_final']})"
        for k in r0["final"]:
            assert r0["final"][k] == r1["final"][k], f"stage {stage}: ranks disagree on {k}"


def _clipping(topo):
    cache, errors = {}, []
    for stage in range(4):
        for optimizer in ("SGD", "AdamW"):
            case = Case(stage=stage, clip=0.5, optimizer=optimizer, lr=0.05 if optimizer == "SGD" else 1e-2)
            got = run_engine(topo, case)
            want = cached_reference(cache, case, topo.world_size)
            if not all(n > case.clip * 1.5 for n in want["norms"]):
                errors.append("the reference's gradients are too small for the clip to act")
            errors += compare(got, want, tol=TOLERANCE["fp32"], label=f"clip stage {stage} {optimizer}")
    return errors


def test_clipping_matches_clip_grad_norm():
    errors = run_distributed(_clipping, WORLD)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
