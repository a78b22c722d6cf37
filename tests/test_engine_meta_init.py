"""A model built on the meta device and initialised shard by shard equals the same model built whole."""
import torch

from tests.dist_utils import run_distributed
from tests.engine_cases import Case, loss_of, micro_batch, tiny_llama
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine
from zspeed.train.meta_init import ModuleInit, StateDictInit, init_module_

WORLD = 2


class RecordingInit(ModuleInit):
    """ModuleInit that remembers the most parameter elements it materialised for one module."""

    largest = 0

    def module_values(self, m):
        values = super().module_values(m)
        self.largest = max(self.largest, sum(v.numel() for v in values.values()))
        return values


def _engine(topo, stage, model, init=None):
    config = load_config(Case(kind="llama", stage=stage).ds_config(topo.world_size), world_size=topo.world_size)
    return ZeroEngine(module=model, config=config, topo=topo, init=init)


def _losses(engine, topo, steps=3):
    out = []
    for step in range(steps):
        loss = loss_of("llama", engine, micro_batch("llama", step, topo.rank))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _reference():
    torch.manual_seed(1)
    model = tiny_llama()
    return init_module_(model, model._init_weights, seed=7)


def _meta_model():
    with torch.device("meta"):
        return tiny_llama()


def _mismatches(label, got, want):
    return [f"{label}: {k} differs" for k in want if not torch.equal(got[k], want[k])] + \
           ([f"{label}: keys differ"] if got.keys() != want.keys() else [])


def _meta_cases(topo):
    errors = []
    want = _reference().state_dict()
    total = sum(v.numel() for v in want.values())
    for stage in (0, 2, 3):
        meta = _meta_model()
        init = RecordingInit(meta, meta._init_weights, seed=7)
        engine = _engine(topo, stage, meta, init)
        errors += _mismatches(f"ModuleInit stage {stage}", engine.full_state_dict(), want)
        if not init.largest < total / 3:
            errors.append(f"stage {stage}: materialised {init.largest} of {total} elements at once")
        got_losses, ref_losses = _losses(engine, topo), _losses(_engine(topo, stage, _reference()), topo)
        if got_losses != ref_losses:
            errors.append(f"stage {stage}: losses after meta init {got_losses} vs {ref_losses}")
    for stage in (1, 3):
        meta = _meta_model()
        init = StateDictInit(want, buffer_init=ModuleInit(meta, meta._init_weights, seed=7))
        engine = _engine(topo, stage, meta, init)
        errors += _mismatches(f"StateDictInit stage {stage}", engine.full_state_dict(), want)
        if _losses(engine, topo) != _losses(_engine(topo, stage, _reference()), topo):
            errors.append(f"StateDictInit stage {stage}: training differs from the reference")
    return errors


def test_meta_device_init_matches_whole_model():
    errors = run_distributed(_meta_cases, WORLD)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
