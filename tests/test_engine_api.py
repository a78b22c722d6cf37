"""zspeed.initialize as a DeepSpeed user calls it: config dict, data, scheduler, client optimizer, logging."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import zspeed
from tests.dist_utils import run_distributed
from tests.engine_cases import MLP

WORLD = 2


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _config_built(topo):
    handler = _Lines()
    logging.getLogger("zspeed.train").addHandler(handler)
    logging.getLogger("zspeed.train").setLevel(logging.INFO)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 4))
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "wall_clock_breakdown": True,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}},
              "zero_optimization": {"stage": 2}}
    engine, optimizer, loader, scheduler = zspeed.initialize(model=MLP(), config=config, training_data=data,
                                                             topology=topo)
    facts = {"same_optimizer": optimizer is engine.optimizer, "batches": len(loader), "lrs": [], "boundaries": []}
    for x, y in loader:
        facts["boundaries"].append(engine.is_gradient_accumulation_boundary())
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        facts["lrs"].append(engine.get_lr()[0])
    facts.update(steps=engine.global_steps, scheduler=scheduler is engine.lr_scheduler,
                 log=handler.lines, micro=engine.train_micro_batch_size_per_gpu())
    return facts


def _client_optimizer(topo):
    """A client SGD with two param groups (no weight decay on biases) and a client scheduler factory."""
    def groups(model):
        return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
                {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(groups(model), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    engine, optimizer, _, sched = zspeed.initialize(
        model=model, optimizer=opt, topology=topo, config={"train_micro_batch_size_per_gpu": 2,
                                                           "zero_optimization": {"stage": 1}},
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(F.mse_loss(engine(x[2 * topo.rank:2 * topo.rank + 2]), y[2 * topo.rank:2 * topo.rank + 2]))
        engine.step()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    got = engine.full_state_dict()
    diff = max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"diff": diff, "client_kept": optimizer is opt, "groups": len(opt.param_groups),
            "wd": [pg["weight_decay"] for pg in opt.param_groups], "lr": engine.get_lr()}


def _frozen(topo):
    """A frozen block (requires_grad=False) stays put and gets no gradient; the rest trains as the reference."""
    diffs = []
    for stage in (0, 3):
        torch.manual_seed(0)
        model = MLP()
        model.blocks[0].requires_grad_(False)
        ref = MLP()
        ref.load_state_dict(model.state_dict())
        ref.blocks[0].requires_grad_(False)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
        engine, *_ = zspeed.initialize(model=model, topology=topo, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            mine = slice(2 * topo.rank, 2 * topo.rank + 2)
            engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
            engine.step()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        got = engine.full_state_dict()
        diffs.append(max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items()))
        assert all(p.grad is None for p in model.blocks[0].parameters())
    return diffs


def _api(topo):
    return _config_built(topo), _client_optimizer(topo), _frozen(topo)


def test_initialize_like_deepspeed():
    for rank, (built, client, frozen) in enumerate(run_distributed(_api, WORLD)):
        assert max(frozen) < 1e-5, f"training with a frozen block differs from the reference: {frozen}"
        assert built["same_optimizer"] and built["scheduler"] and built["micro"] == 2
        assert built["batches"] == 32 // WORLD // 2  # each rank its share, in micro-batches
        assert built["boundaries"] == [False, True] * 4
        assert built["steps"] == 4
        assert built["lrs"] == sorted(built["lrs"]) and built["lrs"][-1] > built["lrs"][0]
        if rank == 0:
            assert len(built["log"]) == 2
            assert all(w in line for line in built["log"] for w in ("tokens/s", "loss", "forward", "step"))
        else:
            assert built["log"] == []
        assert client["client_kept"] and client["groups"] == 2 and client["wd"] == [0.1, 0.0]
        assert client["lr"] == [0.1 * 0.5 ** 3] * 2
        assert client["diff"] < 1e-5, f"client optimizer run differs from the reference by {client['diff']}"


@pytest.mark.parametrize("cls,fused", [(torch.optim.AdamW, False), (torch.optim.AdamW, True),
                                       (torch.optim.Adam, False)])
def test_flat_adam_state_is_bit_exact_and_one_buffer_per_moment(cls, fused):
    from zspeed.train.optim_factory import flat_adam_state

    def run(flat: bool):
        torch.manual_seed(0)
        params = [torch.randn(7, 5, requires_grad=True), torch.randn(13, requires_grad=True)]
        opt = cls([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=0.1,
                  weight_decay=0.01, fused=fused or None)
        if flat:
            assert flat_adam_state(opt, on_cpu=True)
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p) * (step + 1)
            opt.step()
        return params, opt

    ref, _ = run(False)
    got, opt = run(True)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    storages = {opt.state[p][k].untyped_storage().data_ptr() for p in got for k in ("exp_avg",)}
    assert len(storages) == 1  # one flat buffer for every parameter's first moment
    assert flat_adam_state(opt, on_cpu=True) is False  # existing state is never replaced


def test_flat_adam_state_leaves_other_optimizers_and_cpu_alone():
    from zspeed.train.optim_factory import flat_adam_state
    p = torch.zeros(3, requires_grad=True)
    assert flat_adam_state(torch.optim.SGD([p], lr=0.1)) is False
    assert flat_adam_state(torch.optim.AdamW([p], lr=0.1, amsgrad=True), on_cpu=True) is False
    assert flat_adam_state(torch.optim.AdamW([p], lr=0.1)) is False  # CPU parameters need on_cpu
