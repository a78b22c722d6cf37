"""The chunked host update of the offloaded optimizer (see [Note: the chunked host update] in
zspeed.train.host_adam) is bit for bit torch's ``optimizer.step()``.

* Directly: masters, moments, ``step`` and the 16-bit output equal those of ``master.grad = fp32(grad) ×
  scale; optimizer.step()`` over several steps, for Adam and AdamW, with weight decay, a scale != 1,
  groups that are not a multiple of the (shrunk) chunk, per-group hyperparameters, amsgrad, maximize, a
  tensor lr, a frozen view; optimizers it does not cover get no plan.
* In the engine: offloaded training through the chunked path equals training through the
  ``optimizer.step()`` path (clipping, fp16 loss scale, NVMe, delayed update), and SGD still trains.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.engine_cases import Case, loss_of, make_model, micro_batch
from zspeed.core.topology import Topology
from zspeed.train import host_adam, offload
from zspeed.train.checkpoint_state import optimizer_scalars
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine
from zspeed.train.host_adam import Scratch, chunked_adam_update, fused_adam_plan

SIZES = (1000, 3 * 64 + 5, 37, 640)  # elements per master: across, within and exactly at chunks of 256
STEPS = 4
SCALE = 0.37  # clip coefficient / loss scale


def _masters(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES]


def _grad(n: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + n)
    return torch.randn(n, generator=g).to(dtype)


def _optimizer(cls, masters: list[torch.Tensor], **kw) -> torch.optim.Optimizer:
    """Two param groups with their own hyperparameters (the plan must read the master's own group)."""
    groups = [{"params": masters[:2]}, {"params": masters[2:], "lr": 3e-3, "weight_decay": 0.0}]
    return cls(groups, **{"lr": 1e-2, "weight_decay": 0.1, "fused": True, **kw})


def _train_pair(cls, dtype: torch.dtype, **kw) -> tuple[list, list, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The same masters trained by ``optimizer.step()`` (want) and by the chunked update (got)."""
    want_m, got_m = _masters(), _masters()
    want_opt, got_opt = _optimizer(cls, want_m, **kw), _optimizer(cls, got_m, **kw)
    scratch = Scratch()
    for step in range(STEPS):
        for w, g in zip(want_m, got_m):
            grad = _grad(w.numel(), step, dtype)
            w.grad = grad.to(torch.float32, copy=True).mul_(SCALE)
            want_opt.step()
            w.grad = None
            out = torch.empty(g.numel(), dtype=dtype)
            plan = fused_adam_plan(got_opt, g)
            assert plan is not None
            chunked_adam_update(plan, master=g, grad=grad, scale=SCALE, out=out, scratch=scratch)
            assert torch.equal(out, w.to(dtype)), f"16-bit output of a {w.numel()}-element master, step {step}"
    return want_m, got_m, want_opt, got_opt


def _assert_same_state(want_m, got_m, want_opt, got_opt) -> None:
    for w, g in zip(want_m, got_m):
        assert torch.equal(g, w), f"master of {w.numel()} elements"
        sw, sg = want_opt.state[w], got_opt.state[g]
        assert list(sg) == list(sw)  # the same keys in torch's order
        for k in sw:
            assert sg[k].dtype == sw[k].dtype and sg[k].shape == sw[k].shape and torch.equal(sg[k], sw[k]), k
    assert float(got_opt.state[got_m[0]]["step"]) == STEPS
    want_sd, got_sd = want_opt.state_dict(), got_opt.state_dict()
    assert got_sd["param_groups"] == want_sd["param_groups"]


def _set_chunk(monkeypatch, numel: int) -> None:
    monkeypatch.setattr(host_adam, "CHUNK_NUMEL", numel)


@pytest.fixture
def small_chunks(monkeypatch):
    _set_chunk(monkeypatch, 256)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_update_equals_optimizer_step(small_chunks, cls, dtype):
    _assert_same_state(*_train_pair(cls, dtype))


@pytest.mark.parametrize("kw", [{"amsgrad": True}, {"maximize": True}, {"lr": torch.tensor(2e-3)}],
                         ids=["amsgrad", "maximize", "tensor-lr"])
def test_chunked_update_options(small_chunks, kw):
    _assert_same_state(*_train_pair(torch.optim.AdamW, torch.bfloat16, **kw))


def test_unaligned_chunk_constant_is_rounded(monkeypatch):
    """A chunk boundary inside a vector would change rounding; the chunk is rounded to ALIGN."""
    _set_chunk(monkeypatch, 100)
    _assert_same_state(*_train_pair(torch.optim.AdamW, torch.bfloat16))


def test_frozen_view_keeps_its_hyperparameters(small_chunks):
    """A delayed update runs after the lr scheduler stepped: it must use the view's lr, not the live one."""
    want_m, got_m = _masters(), _masters()
    want_opt, got_opt = _optimizer(torch.optim.AdamW, want_m), _optimizer(torch.optim.AdamW, got_m)
    view = offload._frozen(got_opt)
    for pg in got_opt.param_groups:
        pg["lr"] = 1.0
    grads = [_grad(m.numel(), 0, torch.bfloat16) for m in want_m]
    for w, grad in zip(want_m, grads):
        w.grad = grad.float()
    want_opt.step()
    for g, grad in zip(got_m, grads):
        chunked_adam_update(fused_adam_plan(view, g), master=g, grad=grad, scale=1.0,
                            out=torch.empty_like(grad), scratch=Scratch())
    assert all(torch.equal(w, g) for w, g in zip(want_m, got_m))
    assert got_opt.state[got_m[0]]["exp_avg"] is view.state[got_m[0]]["exp_avg"]


def test_what_the_plan_does_not_cover():
    def plan(make):
        m = torch.randn(300)
        return fused_adam_plan(make([m]), m)

    class MyAdam(torch.optim.AdamW):
        pass

    assert plan(lambda p: torch.optim.AdamW(p, fused=True)) is not None
    assert plan(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)) is None
    assert plan(lambda p: torch.optim.AdamW(p, foreach=True)) is None
    assert plan(lambda p: torch.optim.AdamW(p)) is None  # fused=None: torch does not fuse either
    assert plan(lambda p: MyAdam(p, fused=True)) is None  # a subclass may step differently
    assert plan(lambda p: torch.optim.AdamW(p, betas=(torch.tensor(0.9), torch.tensor(0.99)), fused=True)) is None

    def hooked(p):
        opt = torch.optim.AdamW(p, fused=True)
        opt.register_step_post_hook(lambda *a: None)
        return opt
    assert plan(hooked) is None  # step() would run the hook


def test_chunks_are_aligned(monkeypatch):
    for numel in (1, 50, 1000, 1 << 20):
        monkeypatch.setattr(host_adam, "CHUNK_NUMEL", numel)
        assert host_adam.chunk_numel() % host_adam.ALIGN == 0 and host_adam.chunk_numel() >= host_adam.ALIGN


def test_scratch_grows_and_is_reused():
    s = Scratch()
    a = s.take(100)
    assert s.take(50).data_ptr() == a.data_ptr() and s.take(200).numel() == 200


# -- in the engine --------------------------------------------------------------------------------

def _engine(case: Case, offload_cfg: dict, *, adam_w_mode: bool = True, schedule: bool = False) -> ZeroEngine:
    cfg = case.ds_config(1)
    cfg["zero_optimization"]["offload_optimizer"] = offload_cfg
    if case.optimizer == "Adam":
        cfg["optimizer"]["params"]["adam_w_mode"] = adam_w_mode
    if schedule:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": case.lr,
                                                           "warmup_num_steps": case.steps}}
    return ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=1), topo=Topology.single())


def _train(engine: ZeroEngine, steps: int) -> dict:
    losses, norms = [], []
    for step in range(steps):
        for k in range(engine.config.gradient_accumulation_steps):
            loss = loss_of("llama", engine, micro_batch("llama", step, k))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        norms.append(engine.last_outcome.grad_norm)
    arrays = [engine.offload.arrays(g) for g in engine.groups if g.trainable]
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict(master=True), "arrays": arrays,
            "scalars": optimizer_scalars(engine.optimizer)}


def _same(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"] and got["norms"] == want["norms"]
    assert got["scalars"] == want["scalars"]
    for name, w in want["params"].items():
        assert torch.equal(got["params"][name], w), name
    for g, w in zip(got["arrays"], want["arrays"]):
        assert list(g) == list(w) and all(torch.equal(g[k], w[k]) for k in w), list(w)


ENGINE_CASES = {  # label: (case, offload device, Adam's adam_w_mode, delayed_update, lr schedule)
    "adamw-bf16-clip": (Case(kind="llama", stage=2, precision="bf16", gas=2, clip=0.5), "cpu", True, None, False),
    "adam-fp32-clip": (Case(kind="llama", stage=1, precision="fp32", clip=0.5, optimizer="Adam"), "cpu", False,
                       None, False),
    "adamw-fp16-loss-scale": (Case(kind="llama", stage=2, precision="fp16"), "cpu", True, None, False),
    "adamw-bf16-nvme": (Case(kind="llama", stage=3, precision="bf16", clip=0.5), "nvme", True, None, False),
    "adamw-bf16-delayed": (Case(kind="llama", stage=2, precision="bf16", clip=0.5), "cpu", True, 1, True),
}


@pytest.mark.parametrize("label", list(ENGINE_CASES))
def test_engine_chunked_update_equals_step_path(label, tmp_path, monkeypatch):
    case, device, adam_w_mode, delayed, schedule = ENGINE_CASES[label]
    _set_chunk(monkeypatch, 640)  # groups of 1-4K elements span several chunks
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return chunked_adam_update(*args, **kwargs)

    def run(chunked: bool, root: str) -> dict:
        with monkeypatch.context() as m:
            m.setattr(offload, "chunked_adam_update", counting)
            if not chunked:  # every update through optimizer.step()
                m.setattr(offload, "fused_adam_plan", lambda optimizer, master: None)
            cfg = {"device": device, "nvme_path": root, "delayed_update": delayed}
            engine = _engine(case, cfg, adam_w_mode=adam_w_mode, schedule=schedule)
            want_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
            assert type(engine.optimizer) is want_cls and engine.optimizer.param_groups[0]["fused"]
            return _train(engine, case.steps)

    want = run(False, str(tmp_path / "step"))
    assert not calls
    got = run(True, str(tmp_path / "chunked"))
    assert calls  # the chunked path ran
    _same(got, want)


def test_engine_sgd_takes_the_step_path(monkeypatch):
    calls = []
    monkeypatch.setattr(offload, "chunked_adam_update", lambda *a, **k: calls.append(1))
    case = Case(kind="llama", stage=2, precision="bf16", clip=0.5, optimizer="SGD")
    got = _train(_engine(case, {"device": "cpu"}), case.steps)
    assert not calls
    plain = Case(kind="llama", stage=2, precision="bf16", clip=0.5, optimizer="SGD")
    cfg = plain.ds_config(1)
    want_engine = ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=1), topo=Topology.single())
    losses = []
    for step in range(case.steps):
        loss = loss_of("llama", want_engine, micro_batch("llama", step, 0))
        want_engine.backward(loss)
        want_engine.step()
        losses.append(loss.item())
    assert got["losses"] == pytest.approx(losses, rel=2e-3)
    want = want_engine.full_state_dict(master=True)
    assert all(torch.allclose(got["params"][n].float(), w.float(), atol=2e-2) for n, w in want.items())


def test_lr_scheduler_sees_the_step():
    """The chunked path replaces optimizer.step(): torch's scheduler must not warn it was never called."""
    case = Case(kind="llama", stage=2, precision="bf16", clip=0.5, steps=2)
    engine = _engine(case, {"device": "cpu"}, schedule=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        _train(engine, case.steps)


def test_update_into_other_arrays_leaves_the_state_and_matches_in_place(monkeypatch):
    """``into`` ([Note: speculative update] in zspeed.train.offload): the result lands in the given arrays,
    bit for bit the in-place update's, and the master, its moments and the step count are untouched."""
    monkeypatch.setattr(host_adam, "CHUNK_NUMEL", 256)
    masters, twins = _masters(), _masters()
    opt, twin_opt = _optimizer(torch.optim.AdamW, masters), _optimizer(torch.optim.AdamW, twins)
    scratch = Scratch()
    for step in range(2):  # the second step starts from non-zero moments
        for m, t in zip(masters, twins):
            grad = _grad(m.numel(), step, torch.bfloat16)
            plan, twin_plan = fused_adam_plan(opt, m), fused_adam_plan(twin_opt, t)
            before = [x.clone() for x in (m, plan.exp_avg, plan.exp_avg_sq, plan.step)]
            into = tuple(torch.full_like(m, float("nan")) for _ in range(3))
            out = torch.empty(m.numel(), dtype=torch.bfloat16)
            chunked_adam_update(plan, master=m, grad=grad, scale=SCALE, out=out, scratch=scratch, into=into)
            assert all(torch.equal(a, b) for a, b in zip((m, plan.exp_avg, plan.exp_avg_sq, plan.step), before))
            twin_out = torch.empty_like(out)
            chunked_adam_update(twin_plan, master=t, grad=grad, scale=SCALE, out=twin_out, scratch=scratch)
            assert torch.equal(into[0], t) and torch.equal(into[1], twin_plan.exp_avg)
            assert torch.equal(into[2], twin_plan.exp_avg_sq) and torch.equal(out, twin_out)
            m.copy_(into[0]), plan.exp_avg.copy_(into[1]), plan.exp_avg_sq.copy_(into[2]), plan.step.add_(1)
    with pytest.raises(ValueError, match="into"):
        chunked_adam_update(fused_adam_plan(opt, masters[0]), master=masters[0], grad=torch.zeros(SIZES[0]),
                            scale=1.0, out=torch.empty(SIZES[0]), scratch=scratch, into=(torch.empty(3),) * 3)
