"""Activation checkpointing (HF decoder layers, and plain blocks) gives the losses and weights of the
run without it, at stages 0 and 3, and really recomputes (inner modules run twice per micro-batch)."""
from tests.dist_utils import run_distributed
from tests.engine_cases import TOLERANCE, Case, build_engine, cached_reference, compare, loss_of, micro_batch

WORLD = 2
CASES = [Case(kind="llama", stage=0, act_ckpt=True), Case(kind="llama", stage=3, act_ckpt=True),
         Case(kind="mlp", stage=3, act_ckpt=True, block_classes=("Block",)),
         Case(kind="mlp", stage=2, act_ckpt=True, block_classes=("Block",), gas=2)]


def _inner_module(engine, kind):
    return engine.module.model.layers[0].mlp if kind == "llama" else engine.module.blocks[0].fc1


def _train(topo, case):
    engine = build_engine(topo, case)
    calls = []
    # a pre-hook: the non-reentrant recompute stops early, inside the module, so post-hooks do not fire
    _inner_module(engine, case.kind).register_forward_pre_hook(lambda *a: calls.append(1))
    losses, norms = [], []
    for step in range(case.steps):
        total = 0.0
        for k in range(case.gas):
            loss = loss_of(case.kind, engine, micro_batch(case.kind, step, k * topo.world_size + topo.rank))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / case.gas)
        norms.append(engine.last_outcome.grad_norm)
    return engine, losses, norms, len(calls)


def _checkpointed_vs_plain(topo):
    cache, errors = {}, []
    for case in CASES:
        engine, losses, norms, calls = _train(topo, case)
        plain_engine, plain_losses, _, plain_calls = _train(topo, Case(**{**case.__dict__, "act_ckpt": False}))
        label = f"{case.kind} stage {case.stage} checkpointed"
        micro = case.steps * case.gas
        if calls != 2 * micro or plain_calls != micro:
            errors.append(f"{label}: inner module ran {calls} times (plain: {plain_calls}) for {micro} micro-batches")
        if losses != plain_losses:
            errors.append(f"{label}: losses {losses} differ from the plain run's {plain_losses}")
        got = {"losses": [], "norms": norms, "params": engine.full_state_dict(master=True)}
        want = cached_reference(cache, case, topo.world_size)
        errors += compare(got, {**want, "losses": []}, tol=TOLERANCE["fp32"], label=label)
    return errors


def test_activation_checkpointing_matches_plain_run():
    errors = run_distributed(_checkpointed_vs_plain, WORLD)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
