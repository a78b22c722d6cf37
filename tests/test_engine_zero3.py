"""Stage 3 mechanics: units gather before use, the next unit is prefetched along the recorded order,
at most two units are live in forward, everything is released after backward and after eval."""
import torch

from tests.dist_utils import run_distributed
from tests.engine_cases import Case, build_engine, loss_of, micro_batch
from zspeed.train.param_group_state import ParamState

WORLD = 2


def _observe(topo):
    engine = build_engine(topo, Case(kind="llama", stage=3))
    units = [u for u in engine.units if not u.persistent]
    seen: list[tuple[int, list[str]]] = []

    def snapshot(unit):
        return lambda *a: seen.append((unit.index, [u.groups[0].state.value for u in units]))
    for u in units:  # registered after the engine's hooks, so they run after the gather
        u.module.register_forward_pre_hook(snapshot(u))
    for step in range(2):
        seen.clear()
        engine.backward(loss_of("llama", engine, micro_batch("llama", step, topo.rank)))
        engine.step()
        released = all(g.state is ParamState.SHARDED for u in units for g in u.groups)
    order = [u.index for u in engine.hooks.order]
    with torch.no_grad():
        engine.eval()
        engine(**micro_batch("llama", 9, topo.rank))
    released_after_eval = all(g.state is ParamState.SHARDED for u in units for g in u.groups)
    persistent = [n for u in engine.units if u.persistent for g in u.groups for n in g.names]
    return {"seen": seen, "order": order, "released": released, "released_after_eval": released_after_eval,
            "units": [u.index for u in units], "persistent": persistent}


def test_stage3_gathers_prefetches_and_releases():
    for r in run_distributed(_observe, WORLD):
        assert r["released"] and r["released_after_eval"]
        assert r["persistent"] == ["model.embed_tokens.weight"]  # tied with lm_head: always gathered
        assert r["order"] == r["units"], "forward order should follow the module order in this model"
        position = {u: i for i, u in enumerate(r["units"])}
        for index, states in r["seen"]:  # second iteration: prefetch is planned
            i = position[index]
            assert states[i] == "gathered"
            if i + 1 < len(states):
                assert states[i + 1] in ("gathering", "gathered"), f"unit after {index} not prefetched: {states}"
            live = sum(s != "sharded" for s in states)
            assert live <= 2, f"{live} units gathered at once: {states}"
