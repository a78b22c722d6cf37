"""Each rank holds what the ZeRO formulas say (core.memory), within padding, at every stage."""
from tests.dist_utils import run_distributed
from tests.engine_cases import Case, build_engine, loss_of, micro_batch
from zspeed.core.memory import tensor_bytes, zero_memory_per_rank

WORLD = 2
BYTES_PER_PARAM = {"fp32": 16, "bf16": 16}


def _held(topo):
    rows = []
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            engine = build_engine(topo, Case(stage=stage, precision=precision))
            engine.backward(loss_of("mlp", engine, micro_batch("mlp", 0, topo.rank)))
            engine.step()
            # Measure where the formula's every term exists: gradients reduced, before the step frees them.
            engine.backward(loss_of("mlp", engine, micro_batch("mlp", 1, topo.rank)))
            num_params = sum(g.numel for g in engine.groups)
            padding = sum(g.group.full_numel - g.group.data_numel for g in engine.groups)
            slack = BYTES_PER_PARAM[precision] * padding + 8 * len(engine.groups)  # + Adam's step counters
            want = zero_memory_per_rank(num_params, stage=stage, world_size=topo.world_size,
                                        precision=precision, optimizer="adam",
                                        separate_param_shard=False).total
            for g in engine.groups:
                g.wait_reductions()
            got = tensor_bytes(engine.model_state_tensors())
            engine.step()
            gathered = sum(g.full.untyped_storage().nbytes() for g in engine.groups)
            rows.append((precision, stage, got, want, slack, gathered, num_params))
    return rows


def test_memory_matches_zero_formula():
    for rank_rows in run_distributed(_held, WORLD):
        for precision, stage, got, want, slack, gathered, num_params in rank_rows:
            assert abs(got - want) <= slack, (f"{precision} stage {stage}: holds {got} B, the formula says {want} B "
                                              f"(slack {slack} B for padding)")
            if stage == 3:
                assert gathered == 0, f"{precision} stage 3: {gathered} B of gathered parameters left after step"
            else:
                assert gathered >= num_params * (4 if precision == "fp32" else 2)


def _packed_storage(topo):
    import torch
    from zspeed.train.config import load_config
    from zspeed.train.engine import ZeroEngine
    from tests.engine_cases import Case, make_model
    out = {}
    for stage in (0, 1, 2):
        case = Case(kind="llama", stage=stage, precision="bf16")
        engine = ZeroEngine(module=make_model("llama"), config=load_config(case.ds_config(topo.world_size),
                            world_size=topo.world_size), topo=topo)
        storages = {}
        for g in engine.groups:
            for name in ("full", "master", "full_grad"):
                t = getattr(g, name)
                if t is not None and t.untyped_storage().nbytes():
                    storages.setdefault((name, t.dtype), set()).add(t.untyped_storage().data_ptr())
        params_in_full = all(p.untyped_storage().data_ptr() == g.full.untyped_storage().data_ptr()
                             for g in engine.groups for p in g.params) 
        out[stage] = {"groups": len(engine.groups), "params_in_full": params_in_full,
                      "storages": {f"{k[0]}:{k[1]}": len(v) for k, v in storages.items()}}
    return out


def test_persistent_buffers_are_one_flat_buffer_per_dtype():
    """Stages 0-2 keep every group's full, master and full_grad in one buffer per dtype."""
    from tests.dist_utils import run_distributed
    r = run_distributed(_packed_storage, 2)[0]
    for stage in (0, 1, 2):
        assert r[stage]["groups"] > 1
        assert r[stage]["params_in_full"] is True
        # full (bf16) and full_grad (bf16) share the bf16 buffer; masters (fp32) have their own
        assert set(r[stage]["storages"].values()) == {1}, r[stage]
