"""The offloaded CPU update overlapped with the device (see [Note: overlapping the CPU update] and
[Note: delayed parameter update] in zspeed.train.offload).

* Without clipping and fp16 each group's update starts as soon as its gradient is on the host; the
  results are bit for bit those of the unoverlapped path (the update after the whole backward).
* With ``offload_optimizer.delayed_update = W`` (DPU), a reference that applies every update from step
  W on one step late (the exact engine, whose published parameters the test replaces by the previous
  step's) gives exactly DPU's losses, grad norms and final masters; steps up to W are exact.
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.engine_cases import Case, loss_of, make_model, micro_batch
from tests.test_offload import offload_config, run
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine

WORLD = 2
STEPS = 5
WARMUP = 2  # delayed_update: exact steps before DPU starts


def build(topo, stage: int, precision: str, offload: dict, *, clip: float, schedule: bool = False) -> ZeroEngine:
    case = Case(kind="llama", stage=stage, precision=precision, gas=2, clip=clip)
    cfg = case.ds_config(topo.world_size)
    cfg["zero_optimization"].update(offload)
    if schedule:  # the lr changes every step: a delayed update must use the lr of its own step
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": case.lr,
                                                           "warmup_num_steps": STEPS, "warmup_type": "linear"}}
    return ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=topo.world_size), topo=topo)


def _same(got: dict, want: dict, label: str) -> list[str]:
    errors = []
    if got["losses"] != want["losses"]:
        errors.append(f"{label}: losses {got['losses']} vs {want['losses']}")
    if got["norms"] != want["norms"]:
        errors.append(f"{label}: grad norms {got['norms']} vs {want['norms']}")
    errors += [f"{label}: parameter {n} differs" for n, w in want["params"].items()
               if not torch.equal(got["params"][n], w)][:1]
    return errors


# -- exact overlap ----------------------------------------------------------------------------

OVERLAP_CASES = [(1, "bf16", "optimizer", "cpu"), (2, "fp32", "optimizer", "cpu"), (2, "bf16", "optimizer", "nvme"),
                 (3, "bf16", "optimizer", "cpu"), (3, "bf16", "both", "cpu")]


def _overlap_grid(topo, root: str) -> list[str]:
    errors = []
    for stage, precision, kind, device in OVERLAP_CASES:
        label = f"stage {stage} {precision} {kind} offload to {device}"
        runs = {}
        for early in (False, True):
            engine = build(topo, stage, precision, offload_config(kind, device, f"{root}/{stage}{kind}{device}{early}"),
                           clip=0.0)
            assert engine.offload.early_start  # no clipping, no fp16: the overlapped path is the default
            engine.offload.early_start = early
            runs[early] = run(engine, topo, STEPS)
            trainable = sum(g.trainable for g in engine.groups)
            if engine.offload.early_updates != (STEPS * trainable if early else 0):
                errors.append(f"{label}: {engine.offload.early_updates} updates started during backward, "
                              f"expected {STEPS * trainable if early else 0}")
        errors += _same(runs[True], runs[False], label)
    return errors


def test_overlapped_update_is_bit_exact(tmp_path):
    errors = run_distributed(_overlap_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def test_clipping_and_fp16_keep_the_update_in_step():
    from zspeed.core.topology import Topology
    topo = Topology.single()
    for precision, clip in (("bf16", 1.0), ("fp16", 0.0)):
        assert not build(topo, 2, precision, offload_config("optimizer", "cpu", ""), clip=clip).offload.early_start


# -- speculative update under clipping --------------------------------------------------------

SPECULATIVE_CASES = [(2, "optimizer"), (3, "optimizer"), (3, "both")]


def _speculative_grid(topo, root: str) -> list[str]:
    """[Note: speculative update]: bit for bit the exact clipped engine, whether the clip never fires (every
    speculation kept), always fires (every one dropped) or fires on some steps; kept/dropped counts as the
    exact engine's norms say."""
    errors = []
    for stage, kind in SPECULATIVE_CASES:
        unclipped = run(build(topo, stage, "bf16", offload_config(kind, "cpu", f"{root}/u{stage}{kind}"), clip=0.0),
                        topo, STEPS)["norms"]
        middle = (min(unclipped) * max(unclipped)) ** 0.5
        for clip in (1e9, 1e-6, middle):
            label = f"stage {stage} {kind} offload, clip {clip:.3g}"

            def engine(speculative: bool):
                opt = offload_config(kind, "cpu", f"{root}/{stage}{kind}{clip}{speculative}")
                opt["offload_optimizer"]["speculative_update"] = speculative
                return build(topo, stage, "bf16", opt, clip=clip)
            exact = run(engine(False), topo, STEPS)
            spec_engine = engine(True)
            assert spec_engine.offload.speculative and not spec_engine.offload.early_start
            got = run(spec_engine, topo, STEPS)
            errors += _same(got, exact, label)
            unclipped_steps = [n + 1e-6 <= clip for n in exact["norms"]]
            want = {"kept": 0, "dropped": 0, "skipped": 0}
            for i, ok in enumerate(unclipped_steps):  # a step speculates if the one before it was not clipped
                want["skipped" if i and not unclipped_steps[i - 1] else "kept" if ok else "dropped"] += 1
            if spec_engine.offload.speculation != want:
                errors.append(f"{label}: speculation {spec_engine.offload.speculation}, expected {want}")
            if clip == middle and not 0 < sum(unclipped_steps) < STEPS:
                errors.append(f"{label}: the middle clip should fire on some steps only: norms {exact['norms']}")
    return errors


def test_speculative_update_is_the_exact_clipped_update(tmp_path):
    errors = run_distributed(_speculative_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def test_speculative_update_config_key():
    import pytest
    from zspeed.train.config import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    for extra, match in (({"device": "nvme", "nvme_path": "/tmp/x"}, "needs device 'cpu'"),
                         ({"device": "cpu", "delayed_update": 2}, "set one of them")):
        cfg = dict(base, zero_optimization={"stage": 2, "offload_optimizer": dict(extra, speculative_update=True)})
        with pytest.raises(ConfigError, match=match):
            load_config(cfg, world_size=1)


# -- the streamed device update ----------------------------------------------------------------

STREAMED_CASES = [(1, "bf16", 1.0), (2, "fp32", 0.0), (2, "bf16", 1.0), (2, "fp16", 0.0), (3, "bf16", 1.0)]


def _streamed_grid(topo, root: str) -> list[str]:
    """[Note: the streamed device update]: with ``device_share`` the first groups are updated by the
    StreamedAdam (on the CPU its "device" is the host and its kernel the CPU's), the rest by the worker, and
    the engine trains bit for bit as with every update on the worker; a checkpoint of the split engine
    resumes in an unsplit one (and the other way round) with the same losses."""
    errors = []
    for stage, precision, clip in STREAMED_CASES:
        for share in (0.5, 1.0):
            label = f"stage {stage} {precision} clip {clip}, device_share {share}"

            def engine(device_share: float, tag: str) -> ZeroEngine:
                opt = offload_config("optimizer", "cpu", f"{root}/{stage}{precision}{share}{tag}")
                opt["offload_optimizer"]["device_share"] = device_share
                return build(topo, stage, precision, opt, clip=clip)
            exact, split = engine(0.0, "exact"), engine(share, "split")
            assert exact.offload.streamed is None
            # [Note: prefetching the state during backward]: the CPU has no device memory to measure, so the
            # budget is given: room for everything (share 0.5), or for ~one group's state per call (share 1).
            split.offload.prefetch_budget = (lambda: 1 << 40) if share < 1.0 else (lambda: 12 * 10_000)
            hosts = split.offload.order
            streamed = [h for h in hosts if h.on_device]
            numel = sum(h.group.numel for h in hosts)
            took = sum(h.group.numel for h in streamed)
            if share == 1.0 and len(streamed) != len(hosts):
                errors.append(f"{label}: {len(streamed)} of {len(hosts)} groups streamed")
            if share < 1.0 and not (0 < len(streamed) < len(hosts) and abs(took / numel - share) < 0.3):
                errors.append(f"{label}: streamed {len(streamed)} of {len(hosts)} groups, {took / numel:.2f} of "
                              "the elements")
            want, got = run(exact, topo, STEPS), run(split, topo, STEPS)
            errors += _same(got, want, label)
            steps = STEPS if precision != "fp16" else sum(1 for n in want["norms"] if n == n)
            if len(split.offload.update_times) < steps - 1 or any(
                    t["host_s"] < 0 or t["publish_wait_s"] < 0 for t in split.offload.update_times):
                errors.append(f"{label}: update times {split.offload.update_times}")
            streamer = split.offload.streamed
            if streamer.prefetched_elements == 0 or streamer._prefetched:
                errors.append(f"{label}: prefetched {streamer.prefetched_elements} elements, "
                              f"{len(streamer._prefetched)} chunks left unused")
            if split.offload.streamed.elements < steps * sum(h.group.hi - h.group.lo for h in streamed):
                errors.append(f"{label}: the device updated {split.offload.streamed.elements} elements in "
                              f"{steps} steps")
            if stage == 2 and precision == "bf16" and share == 0.5:  # checkpoints cross the split both ways
                split.save_checkpoint(f"{root}/ck-split")
                exact.save_checkpoint(f"{root}/ck-exact")
                resumed = [engine(0.0, "r1"), engine(share, "r2")]
                resumed[0].load_checkpoint(f"{root}/ck-split")
                resumed[1].load_checkpoint(f"{root}/ck-exact")
                after = run(split, topo, 2)
                for r, name in zip(resumed, ("split -> unsplit", "unsplit -> split")):
                    errors += _same(run(r, topo, 2), after, f"{label}: {name}")
    return errors


def test_streamed_device_update_is_bit_exact(tmp_path):
    errors = run_distributed(_streamed_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


RESIDENT_CASES = [(1, "bf16", 1.0, 0.75, 0.75), (2, "fp16", 0.0, 0.5, 0.75), (3, "bf16", 1.0, 0.0, 0.5)]


def _resident_grid(topo, root: str) -> list[str]:
    """[Note: resident state (Twin-Flow)]: with ``ratio`` < 1 the first groups keep their state on the "device"
    (on the CPU: arrays of their own), updated there with nothing written back until something reads the host
    state; training is bit for bit that of every update on the worker, the host arrays catch up when a checkpoint
    or the masters are read, and checkpoints cross between resident and offloaded engines both ways (a load
    replaces the resident copies: the losses after it are those of a fresh engine loaded from the same files)."""
    errors = []
    for stage, precision, clip, share, ratio in RESIDENT_CASES:
        label = f"stage {stage} {precision} clip {clip}, device_share {share}, ratio {ratio}"

        def engine(keys: dict, tag: str) -> ZeroEngine:
            opt = offload_config("optimizer", "cpu", f"{root}/{stage}{tag}")
            opt["offload_optimizer"].update(keys)
            e = build(topo, stage, precision, opt, clip=clip)
            e.offload.prefetch_budget = lambda: 1 << 40
            return e
        exact, twin = engine({}, "exact"), engine({"device_share": share, "ratio": ratio}, "twin")
        hosts = twin.offload.order
        resident = [h for h in hosts if h.resident]
        numel = sum(h.group.numel for h in hosts)
        kept = sum(h.group.numel for h in resident)
        if not resident or not all(h.on_device for h in resident) or abs(kept / numel - (1 - ratio)) > 0.3:
            errors.append(f"{label}: {len(resident)} of {len(hosts)} groups resident, {kept / numel:.2f} of the "
                          "elements")
        if share > 1 - ratio and not any(h.on_device and not h.resident for h in hosts):
            errors.append(f"{label}: no group streamed beside the resident ones")
        if max(share, 1 - ratio) < 1 and all(h.on_device for h in hosts):
            errors.append(f"{label}: no group left to the CPU")
        want = run(exact, topo, STEPS)
        got = run(twin, topo, STEPS)
        errors += _same(got, want, label)
        streamer = twin.offload.streamed
        if streamer.resident_elements != sum(h.group.hi - h.group.lo for h in resident):
            errors.append(f"{label}: {streamer.resident_elements} elements resident")
        if any(streamer.prefetched_whole(h.key) for h in resident):
            errors.append(f"{label}: a resident group was prefetched")
        # After a step the host master of a resident group is behind its device copy until something reads it
        # (run() itself ends by reading the masters).
        _step_without_reading(twin, topo)
        h = resident[0]
        device_master = torch.cat([streamer._resident[h.key, lo][0] for lo in range(0, h.group.hi - h.group.lo,
                                                                                     streamer.chunk)])
        if torch.equal(h.group.master, device_master):
            errors.append(f"{label}: the host master was written back after the step (nothing read it)")
        if not torch.equal(twin.offload.master_values(h.group), device_master):
            errors.append(f"{label}: master_values did not bring the host master up to date")
        _step_without_reading(twin, topo)  # stale again; now read off the optimizer
        state = twin.optimizer.state_dict()["state"]
        index = next(i for i, p in enumerate(p for g in twin.optimizer.param_groups for p in g["params"])
                     if p is h.group.master)
        device_avg = torch.cat([streamer._resident[h.key, lo][1] for lo in range(0, h.group.hi - h.group.lo,
                                                                                 streamer.chunk)])
        if not torch.equal(state[index]["exp_avg"], device_avg):
            errors.append(f"{label}: optimizer.state_dict() returned a stale exp_avg of a resident group")
        run(exact, topo, 2)
        twin.save_checkpoint(f"{root}/ck-twin{stage}")
        exact.save_checkpoint(f"{root}/ck-exact{stage}")
        after = run(exact, topo, 2)
        for keys, ck, name in (({}, "twin", "resident -> offloaded"),
                               ({"device_share": share, "ratio": ratio}, "exact", "offloaded -> resident")):
            r = engine(keys, f"r{ck}")
            r.load_checkpoint(f"{root}/ck-{ck}{stage}")
            errors += _same(run(r, topo, 2), after, f"{label}: {name}")
        run(twin, topo, 1)  # resident state newer than the checkpoint, loaded over
        twin.load_checkpoint(f"{root}/ck-exact{stage}")
        errors += _same(run(twin, topo, 2), after, f"{label}: loaded over resident state")
    return errors


def _step_without_reading(engine: ZeroEngine, topo) -> None:
    """One step, as run() takes it, without reading anything back (run() ends by reading the masters)."""
    for k in range(engine.config.gradient_accumulation_steps):
        engine.backward(loss_of("llama", engine, micro_batch("llama", engine.global_steps,
                                                             k * topo.world_size + topo.rank)))
        engine.step()


def test_resident_state_is_bit_exact_and_checkpoints(tmp_path):
    errors = run_distributed(_resident_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def test_prefetch_keeps_at_most_depth_chunks_in_flight():
    """[Note: prefetching the state during backward]: ``prefetch_depth`` uploads at a time; the next chunks go
    once earlier ones complete (events are faked: on the CPU every event is complete at once)."""
    from zspeed.core.device import DeviceHandle
    from zspeed.train.host_adam import ALIGN
    from zspeed.train.streamed_adam import StreamedAdam

    class Pending:
        def __init__(self):
            self.done = False

        def record(self, stream=None):
            pass

        def query(self):
            return self.done

    events: list[Pending] = []

    class Host(DeviceHandle):  # the CPU handle, its events pending until a test says otherwise
        def new_event(self, *, timing: bool = False) -> Pending:
            events.append(Pending())
            return events[-1]

    dev = Host(torch.device("cpu"))
    arrays = tuple(torch.randn(5 * ALIGN) for _ in range(3))
    s = StreamedAdam(device=dev, chunk_numel=ALIGN, prefetch_depth=2)
    assert s.prefetch("a", arrays, budget=1 << 40) == 2 * 12 * ALIGN
    assert s.prefetch("a", arrays, budget=1 << 40) == 0 and s.prefetch_room() == 0
    events[0].done = True
    assert s.prefetch("a", arrays, budget=1 << 40) == 12 * ALIGN and not s.prefetched_whole("a")
    for e in events:
        e.done = True
    assert s.prefetch("a", arrays, budget=1 << 40) == 2 * 12 * ALIGN and s.prefetched_whole("a")
    prefetched = sorted(lo for _, lo in s._prefetched)
    assert prefetched == [i * ALIGN for i in range(5)]
    for lo in prefetched:  # each chunk holds its own slice of the three host arrays
        assert all(torch.equal(d, a[lo:lo + ALIGN]) for d, a in zip(s._prefetched["a", lo].arrays, arrays))
    assert s.prefetch("b", arrays, budget=1 << 40) == 0  # the last two are still on their way
    for e in events:
        e.done = True
    assert s.prefetch("b", arrays, budget=12 * ALIGN) == 12 * ALIGN and not s.prefetched_whole("b")
    s.drop_prefetched()
    assert not s._prefetched and not s.prefetched_whole("a")
    off = StreamedAdam(device=dev, chunk_numel=ALIGN, prefetch_depth=0)
    assert off.prefetch("a", arrays, budget=1 << 40) == 0 and not off._prefetched
    import pytest
    with pytest.raises(ValueError, match="prefetch_depth counts chunks in flight"):
        StreamedAdam(device=dev, prefetch_depth=-1)


def _streamed_combinations(topo, root: str) -> list[str]:
    """device_share with the other zspeed keys: speculative update (host groups speculate, streamed groups are
    exact; the clip fires on some steps), overlap_forward on top, and parameter offload at stage 3 (the groups
    the parameter store owns stay on the host; the persistent unit's may stream)."""
    errors = []
    norms = run(build(topo, 2, "bf16", offload_config("optimizer", "cpu", f"{root}/n"), clip=0.0), topo,
                STEPS)["norms"]
    middle = (min(norms) * max(norms)) ** 0.5
    for extra in ({"speculative_update": True}, {"speculative_update": True, "overlap_forward": True}):
        def engine(keys: dict, tag: str) -> ZeroEngine:
            opt = offload_config("optimizer", "cpu", f"{root}/{tag}")
            opt["offload_optimizer"].update(keys)
            return build(topo, 2, "bf16", opt, clip=middle)
        want = run(engine({}, "exact"), topo, STEPS)
        split = engine({"device_share": 0.5, **extra}, "split")
        got = run(split, topo, STEPS)
        errors += _same(got, want, f"device_share 0.5 + {extra}")
        if sum(split.offload.speculation.values()) != STEPS or not split.offload.streamed.elements:
            errors.append(f"{extra}: speculation {split.offload.speculation}, "
                          f"{split.offload.streamed.elements} elements streamed")
    want = run(build(topo, 3, "bf16", offload_config("both", "cpu", f"{root}/both0"), clip=1.0), topo, STEPS)
    both = offload_config("both", "cpu", f"{root}/both")
    both["offload_optimizer"]["device_share"] = 1.0
    e = build(topo, 3, "bf16", both, clip=1.0)
    owned = [h.on_device for h in e.offload.order if e.offload.shard_sink.owns(h.group)]
    if not owned or any(owned):
        errors.append("stage 3 with parameter offload: a group the parameter store owns was streamed")
    errors += _same(run(e, topo, STEPS), want, "stage 3, parameter offload, device_share 1.0")

    # [Note: prefetching the state during backward]: a boundary backward whose step never came leaves uploaded
    # state behind; loaded over (here: the state one step older), it must not be used. The losses after the load
    # are those of a fresh engine loaded from the same checkpoint.
    def prefetching(tag: str) -> ZeroEngine:
        opt = offload_config("optimizer", "cpu", f"{root}/{tag}")
        opt["offload_optimizer"]["device_share"] = 1.0
        engine = build(topo, 2, "bf16", opt, clip=1.0)
        engine.offload.prefetch_budget = lambda: 1 << 40
        return engine
    a, b = prefetching("pa"), prefetching("pb")
    run(a, topo, 2)
    a.save_checkpoint(f"{root}/ck-prefetch")
    run(a, topo, 1)
    gas = a.config.gradient_accumulation_steps
    for k in range(gas):  # every micro-batch of a step, the step itself only counted, never taken
        a.backward(loss_of("llama", a, micro_batch("llama", a.global_steps, k * topo.world_size + topo.rank)))
        if k < gas - 1:
            a.step()
    if not a.offload.streamed._prefetched:
        errors.append("the boundary backward prefetched nothing")
    a.load_checkpoint(f"{root}/ck-prefetch")
    b.load_checkpoint(f"{root}/ck-prefetch")
    errors += _same(run(a, topo, 2), run(b, topo, 2), "load_checkpoint after a backward without its step")
    return errors


def test_device_share_combines_with_the_other_offload_keys(tmp_path):
    errors = run_distributed(_streamed_combinations, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def test_device_share_config_key():
    import pytest
    from zspeed.train.config import ConfigError

    for extra, match in (({"device": "cpu", "device_share": 1.5}, "a fraction of the parameters, 0 to 1"),
                         ({"device": "nvme", "nvme_path": "/tmp/x", "device_share": 0.5}, "Offload to 'cpu'"),
                         ({"device": "cpu", "device_share": 0.5, "delayed_update": 2}, "set one of them"),
                         ({"device": "cpu", "prefetch_depth": -1}, "prefetch_depth must be an integer >= 0"),
                         ({"device": "cpu", "ratio": 1.5}, "fraction of the optimizer state offloaded, 0 to 1"),
                         ({"device": "nvme", "nvme_path": "/tmp/x", "ratio": 0.5}, "Offload to 'cpu' or set ratio"),
                         ({"device": "cpu", "ratio": 0.5, "delayed_update": 2}, "set one of them")):
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": extra}}
        with pytest.raises(ConfigError, match=match):
            load_config(cfg, world_size=1)
    from zspeed.core.topology import Topology
    cfg = Case(kind="llama", stage=2).ds_config(1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    for keys, asked in (({"device_share": 0.5}, "device_share=0.5"), ({"ratio": 0.25}, "ratio=0.25")):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", **keys}
        with pytest.raises(ValueError, match=f"offload_optimizer.{asked}: .*use torch's Adam/AdamW with fused=True"):
            ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=1), topo=Topology.single())


# -- publishing in the next forward -------------------------------------------------------------

OVERLAP_FORWARD_CASES = [(1, "bf16", 1.0, 0.0), (2, "bf16", 1.0, 0.5), (2, "fp32", 0.0, 0.0), (2, "fp16", 0.0, 0.5),
                         (3, "bf16", 1.0, 0.5), (3, "fp32", 0.0, 0.0)]


def _overlap_forward_grid(topo, root: str) -> list[str]:
    """[Note: overlapping the next forward]: the same training bit for bit (so every forward saw the updated
    parameters), with the groups published by the next forward's module hooks: none right after step(), all
    after the forward."""
    errors = []
    for stage, precision, clip, share in OVERLAP_FORWARD_CASES:
        label = f"stage {stage} {precision} clip {clip} device_share {share}"

        def engine(overlap: bool) -> ZeroEngine:
            opt = offload_config("optimizer", "cpu", f"{root}/{stage}{precision}{overlap}")
            opt["offload_optimizer"].update(device_share=share, overlap_forward=overlap)
            return build(topo, stage, precision, opt, clip=clip)
        eager = engine(False)
        want = run(eager, topo, STEPS)
        lazy = engine(True)
        got = run(lazy, topo, STEPS)
        errors += _same(got, want, label)
        need = lazy.offload._need_order  # updates start in the last forward's order; at stage 3 the persistent
        if sorted(map(id, need)) != sorted(map(id, lazy.offload.order)) or (  # unit (the embedding, last in unit
                stage == 3 and not need[0].group.persistent):                  # order) is needed first
            errors.append(f"{label}: updates start in the order {[h.key for h in need]}")
        # One more step by hand: after it no group is published; the next forward publishes them all.
        gas = lazy.config.gradient_accumulation_steps
        for k in range(gas):
            lazy.backward(loss_of("llama", lazy, micro_batch("llama", 0, k * topo.world_size + topo.rank)))
            lazy.step()
        if len(lazy.offload._unpublished) != len(lazy.offload.order):
            errors.append(f"{label}: after step() {len(lazy.offload._unpublished)} of {len(lazy.offload.order)} "
                          "groups unpublished")
        if stage < 3:  # on several ranks a hook publishes every group before its own (the gathers' order)
            lazy.offload._publish_hook((lazy.offload.order[1],))(None, ())
            if list(lazy.offload._unpublished.values()) != lazy.offload.order[2:]:
                errors.append(f"{label}: the second group's hook left {len(lazy.offload._unpublished)} unpublished")
        with torch.no_grad():
            loss_of("llama", lazy, micro_batch("llama", 0, topo.rank))
        if lazy.offload._unpublished:
            errors.append(f"{label}: the forward left {len(lazy.offload._unpublished)} groups unpublished")
        if stage == 2 and share:  # loading over an unpublished update: the update must not land on top of it
            ck = f"{root}/ck{stage}{precision}"
            eager.save_checkpoint(ck)
            saved = eager.full_state_dict()
            after = run(eager, topo, 2)
            for load in ({"load_optimizer_states": False}, {}):
                for k in range(gas):
                    lazy.backward(loss_of("llama", lazy, micro_batch("llama", 0, k * topo.world_size + topo.rank)))
                    lazy.step()
                assert lazy.offload._unpublished
                lazy.load_checkpoint(ck, **load)
                with torch.no_grad():  # the forward publishes nothing over what was loaded
                    loss_of("llama", lazy, micro_batch("llama", 0, topo.rank))
                if any(not torch.equal(v, saved[n]) for n, v in lazy.full_state_dict().items()):
                    errors.append(f"{label}: loading {load} over an unpublished update kept the update")
            errors += _same(run(lazy, topo, 2), after, f"{label}: loaded over an unpublished update")
    return errors


def test_overlap_forward_publishes_in_the_next_forward(tmp_path):
    errors = run_distributed(_overlap_forward_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def test_overlap_forward_config_key():
    import pytest
    from zspeed.core.topology import Topology
    from zspeed.train.config import ConfigError

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "overlap_forward": True, "delayed_update": 1}}}
    with pytest.raises(ConfigError, match="set one of them"):
        load_config(cfg, world_size=1)
    cfg = Case(kind="llama", stage=3).ds_config(1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "overlap_forward": True}
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match="overlap_forward does not combine with offload_param"):
        ZeroEngine(module=make_model("llama"), config=load_config(cfg, world_size=1), topo=Topology.single())


# -- delayed parameter update -----------------------------------------------------------------

DPU_CASES = [(2, "bf16", "cpu", 1.0), (1, "fp32", "nvme", 1.0), (3, "bf16", "cpu", 0.0), (2, "fp16", "cpu", 1.0)]


def _compute_params(engine) -> list[torch.Tensor]:
    """The device copies the forward reads: ``full`` (stages 1-2, and gathered stage-3 groups), ``shard``."""
    out = []
    for g in engine.groups:
        if g.trainable:
            if g.full is not None and g.full.untyped_storage().size():
                out.append(g.full)
            if g.shard is not None:
                out.append(g.shard)
    return out


class OneStepLate:
    """Wraps an exact engine: from step ``warmup`` on, each step's published parameters are replaced by
    those the previous step published (for step ``warmup``: those it started with)."""

    def __init__(self, engine: ZeroEngine, warmup: int):
        self.engine, self.warmup = engine, warmup
        self.previous = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        step = self.engine.global_steps
        if boundary and step == self.warmup:
            self.previous = [t.clone() for t in _compute_params(self.engine)]
        self.engine.step()
        if boundary and step >= self.warmup:
            published = [t.clone() for t in _compute_params(self.engine)]
            with torch.no_grad():
                for t, old in zip(_compute_params(self.engine), self.previous):
                    t.copy_(old)
            self.previous = published


def _dpu_grid(topo, root: str) -> list[str]:
    errors = []
    for stage, precision, device, clip in DPU_CASES:
        label = f"stage {stage} {precision} offload to {device}, clip {clip}"
        opt = offload_config("optimizer", device, f"{root}/{stage}{device}{precision}")

        def cfg(delayed):
            return {"offload_optimizer": dict(opt["offload_optimizer"], delayed_update=delayed,
                                              nvme_path=f"{opt['offload_optimizer']['nvme_path']}{delayed}")}
        dpu = build(topo, stage, precision, cfg(WARMUP), clip=clip, schedule=True)
        got = run(dpu, topo, STEPS)
        assert not dpu.offload._pending  # full_state_dict landed the last step's update
        exact = build(topo, stage, precision, cfg(None), clip=clip, schedule=True)
        exact.offload.early_start = False  # OneStepLate reads the parameters before step() as the old ones
        want = run(OneStepLate(exact, WARMUP), topo, STEPS)
        errors += _same(got, want, f"DPU {label} vs one step late")
        if stage == 2 and precision == "bf16":  # off and warm-up: exact
            exact = run(build(topo, stage, precision, cfg(None), clip=clip, schedule=True), topo, STEPS)
            if got["losses"][:WARMUP + 1] != exact["losses"][:WARMUP + 1]:
                errors.append(f"{label}: warm-up losses {got['losses']} vs exact {exact['losses']}")
            if got["losses"][WARMUP + 1:] == exact["losses"][WARMUP + 1:]:
                errors.append(f"{label}: DPU losses equal the exact ones after warm-up; is it on?")
    return errors


def test_delayed_update_is_the_exact_update_one_step_late(tmp_path):
    errors = run_distributed(_dpu_grid, WORLD, str(tmp_path))
    assert errors == [[], []], "\n".join(errors[0] + errors[1])


def test_delayed_update_config_key():
    import pytest
    from zspeed.train.config import ConfigError, describe_keys

    def parse(offload: dict):
        cfg = {"train_micro_batch_size_per_gpu": 1,
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", **offload}}}
        return load_config(cfg, world_size=1).zero_optimization.offload_optimizer

    assert parse({}).delayed_update is None and parse({"delayed_update": "3"}).delayed_update == 3
    with pytest.raises(ConfigError, match="did you mean 'delayed_update'"):
        parse({"delayed_updates": 2})
    with pytest.raises(ConfigError, match="delayed_update must be >= 0"):
        parse({"delayed_update": -1})
    assert describe_keys()["zero_optimization.offload_optimizer.delayed_update"].startswith("zspeed extension")
