"""Optimizer offload (cpu, nvme; stages 1-3) and parameter offload (stage 3; cpu, nvme) train exactly as
without offload: the same losses and grad norms at every step and the same final weights; and an
offloaded engine's checkpoint resumes without offload (and the other way round)."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.engine_cases import Case, loss_of, make_model, micro_batch
from zspeed.core.comm import ReduceOp, all_reduce
from zspeed.train.config import load_config
from zspeed.train.config_schema import ConfigError
from zspeed.train.engine import ZeroEngine

WORLD = 2


def offload_config(kind: str, device: str, root: str) -> dict:
    out = {}
    if kind in ("optimizer", "both"):
        out["offload_optimizer"] = {"device": device, "nvme_path": f"{root}/opt", "pin_memory": True}
    if kind == "both":
        out["offload_param"] = {"device": device, "nvme_path": f"{root}/param"}
    return out


def build(topo, stage: int, precision: str, offload: dict, *, clip: float = 1.0, gas: int = 2) -> ZeroEngine:
    case = Case(kind="llama", stage=stage, precision=precision, gas=gas, clip=clip)
    cfg = case.ds_config(topo.world_size)
    cfg["zero_optimization"].update(offload)
    return ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=topo.world_size), topo=topo)


def run(engine, topo, steps: int = 4) -> dict:
    gas = engine.config.gradient_accumulation_steps
    losses, norms = [], []
    for _ in range(steps):
        total = torch.zeros(1)
        for k in range(gas):
            loss = loss_of("llama", engine, micro_batch("llama", engine.global_steps, k * topo.world_size + topo.rank))
            engine.backward(loss)
            if engine.offload is not None and engine.policy.shard_grads:  # [Note: the device gradient after its copy]
                held = [g.grad_shard is not None for g in engine.groups if g.trainable]
                assert not any(held) if k == gas - 1 else all(held), (k, held)
            engine.step()
            total += loss.detach().float()
        losses.append(all_reduce(total, topo=topo, op=ReduceOp.AVG).item() / gas)
        norms.append(engine.last_outcome.grad_norm)
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict(master=True)}


CASES = [(stage, kind, device, precision)
         for stage in (1, 2, 3) for kind, device in (("optimizer", "cpu"), ("optimizer", "nvme"))
         for precision in ("fp32", "bf16")] + [
         (3, "both", "cpu", "fp32"), (3, "both", "nvme", "fp32"), (3, "both", "cpu", "bf16"),
         (2, "optimizer", "cpu", "fp16")]  # fp16: the overflow gate and the loss scale work offloaded too


def _grid(topo, root: str) -> list[str]:
    errors, baselines = [], {}
    for stage, kind, device, precision in CASES:
        label = f"stage {stage} {kind} offload to {device} ({precision})"
        if (stage, precision) not in baselines:
            baselines[stage, precision] = run(build(topo, stage, precision, {}), topo)
        want = baselines[stage, precision]
        engine = build(topo, stage, precision, offload_config(kind, device, f"{root}/{stage}{kind}{device}"))
        assert engine.offload is not None and (kind != "both" or engine.param_offload is not None)
        got = run(engine, topo)
        if device == "nvme":  # masters and Adam state live in the store, not in memory
            assert engine.offload.store.nbytes() > 0
            assert all(g.master.numel() == 0 for g in engine.groups if g.trainable)
        if kind == "both":
            po = engine.param_offload
            assert po.streamer.stats.units_loaded >= 4 * len(po.units), (po.streamer.stats, len(po.units), po.window)
        tol = 1e-5 if precision == "fp32" else 2e-3
        if got["losses"] != pytest.approx(want["losses"], rel=tol):
            errors.append(f"{label}: losses {got['losses']} vs {want['losses']}")
        if got["norms"] != pytest.approx(want["norms"], rel=max(tol, 1e-4)):
            errors.append(f"{label}: grad norms {got['norms']} vs {want['norms']}")
        for name, w in want["params"].items():
            if not torch.allclose(got["params"][name].float(), w.float(), rtol=0, atol=1e-5 if tol < 1e-4 else 2e-2):
                errors.append(f"{label}: parameter {name} differs")
                break
    return errors


def test_offload_matches_no_offload(tmp_path):
    errors = run_distributed(_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def _checkpoint_across_offload(topo, root: str) -> dict:
    """Save with nvme optimizer + parameter offload, resume without offload and with cpu offload."""
    engine = build(topo, 3, "fp32", offload_config("both", "nvme", root), gas=1)
    run(engine, topo, 2)
    engine.save_checkpoint(f"{root}/ckpt")
    ref = run(engine, topo, 2)["losses"]
    plain = build(topo, 2, "fp32", {}, gas=1)
    plain.load_checkpoint(f"{root}/ckpt")
    cpu = build(topo, 1, "fp32", offload_config("optimizer", "cpu", root), gas=1)
    cpu.load_checkpoint(f"{root}/ckpt")
    return {"ref": ref, "plain": run(plain, topo, 2)["losses"], "cpu": run(cpu, topo, 2)["losses"]}


def test_offloaded_checkpoints_resume_anywhere(tmp_path):
    r = run_distributed(_checkpoint_across_offload, WORLD, str(tmp_path))[0]
    assert r["plain"] == pytest.approx(r["ref"], rel=1e-5)
    assert r["cpu"] == pytest.approx(r["ref"], rel=1e-5)


def test_parameter_offload_alone_is_refused():
    cfg = Case(kind="llama", stage=3).ds_config(1)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    from zspeed.core.topology import Topology
    with pytest.raises(ConfigError, match="offload_param needs offload_optimizer too"):
        ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=1), topo=Topology.single())


def test_host_update_threads_are_configured_or_shared_by_the_node(monkeypatch):
    from zspeed.core.topology import Topology
    from zspeed.train.offload import host_update_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    assert host_update_threads(0, local_world_size=1) == 30  # two cores left to the threads that drive the GPU
    assert host_update_threads(0, local_world_size=2) == 14
    assert host_update_threads(0, local_world_size=8) == 3
    assert host_update_threads(0, local_world_size=64) == 1  # never zero
    assert host_update_threads(5, local_world_size=2) == 5  # an explicit count wins
    cfg = Case(kind="llama", stage=2).ds_config(1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "host_threads": 1}
    engine = ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=1), topo=Topology.single())
    offload = engine.offload
    assert offload.host_threads == 1
    assert offload._worker.submit(torch.get_num_threads).result() == 1  # the worker's own pool
    cfg["zero_optimization"]["offload_optimizer"]["host_threads"] = -2
    with pytest.raises(ConfigError, match="host_threads must be an integer >= 0"):
        load_config(cfg, world_size=1)
