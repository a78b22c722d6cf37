"""The continuous-batching scheduler, driven step by step with a fake runner and a fake clock."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from zspeed.serve.errors import (
    DrainingError,
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLongError,
)
from zspeed.serve.request import Request, SamplingParams
from zspeed.serve.scheduler import RunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from zspeed.serve.sequence import SequenceStatus, TextStream

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence so far."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


def reference(prompt, max_new_tokens, *, eos=(), stop_token_ids=()) -> tuple[list[int], SequenceStatus]:
    tokens, out = list(prompt), []
    while True:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if out[-1] in eos or any(tuple(out[-len(s):]) == tuple(s) for s in stop_token_ids):
            return out, SequenceStatus.FINISHED_STOPPED
        if len(out) == max_new_tokens:
            return out, SequenceStatus.FINISHED_LENGTH


class FakeRunner:
    """Keeps a per-sequence 'KV cache' of the tokens fed and checks the scheduler feeds them in order."""

    def __init__(self) -> None:
        self.kv: dict[int, list[int]] = {}
        self.freed: list[int] = []
        self.batches: list[SchedulerOutput] = []

    def step(self, batch: SchedulerOutput) -> RunnerOutput:
        self.batches.append(batch)
        out: dict[int, list[int]] = {}
        for chunk in batch.prefills:
            kv = self.kv.setdefault(chunk.seq_id, [])
            assert chunk.start == len(kv), "prefill chunks must be contiguous"
            kv.extend(chunk.token_ids)
            if chunk.is_last:
                out[chunk.seq_id] = [next_token(kv)]
        for item in batch.decodes:
            kv = self.kv[item.seq_id]
            assert item.position == len(kv), "decode position must follow the cache"
            kv.append(item.token_id)
            out[item.seq_id] = [next_token(kv)]
        return RunnerOutput(out)

    def free(self, seq_id: int) -> None:
        self.freed.append(seq_id)
        self.kv.pop(seq_id, None)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Recorder:
    """A StatsObserver that keeps everything."""

    def __init__(self) -> None:
        self.rejected: list[str] = []
        self.queue: list[tuple[int, int]] = []
        self.steps = []
        self.finished = []

    def on_request_rejected(self, reason):
        self.rejected.append(reason)

    def on_queue_changed(self, num_running, num_waiting):
        self.queue.append((num_running, num_waiting))

    def on_step(self, stats):
        self.steps.append(stats)

    def on_request_finished(self, stats):
        self.finished.append(stats)


def req(rid, prompt, max_new_tokens=4, **kw) -> Request:
    deadline = kw.pop("deadline", None)
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling=SamplingParams(max_new_tokens=max_new_tokens, **kw), deadline=deadline)


def step(sched: Scheduler, runner: FakeRunner, clock: FakeClock | None = None) -> SchedulerOutput:
    batch = sched.schedule()
    for seq_id in batch.freed_seq_ids:
        runner.free(seq_id)
    if batch.has_work:
        if clock is not None:
            clock.advance(0.01)
        sched.update(runner.step(batch))
    return batch


def run_all(sched, runner, clock=None, max_steps=10_000):
    events = []
    for _ in range(max_steps):
        batch = step(sched, runner, clock)
        events += sched.pop_events()
        if not batch.has_work and not sched.has_unfinished:
            step(sched, runner, clock)  # frees what finished last
            return events
    raise AssertionError("did not finish")


def outputs(events) -> dict[str, tuple[list[int], SequenceStatus]]:
    out: dict[str, tuple[list[int], SequenceStatus]] = {}
    for e in events:
        tokens, _ = out.get(e.request_id, ([], None))
        out[e.request_id] = (tokens + list(e.token_ids), e.status)
    return out


def admitted_order(runner: FakeRunner) -> list[int]:
    return [c.seq_id for b in runner.batches for c in b.prefills if c.start == 0]


# -- basics ---------------------------------------------------------------------------
def test_one_request_matches_reference_and_is_freed():
    sched, runner = Scheduler(SchedulerConfig()), FakeRunner()
    seq_id = sched.add_request(req("a", [5, 6, 7], max_new_tokens=6))
    events = run_all(sched, runner)
    assert outputs(events)["a"] == reference([5, 6, 7], 6)
    assert [len(e.token_ids) for e in events] == [1] * 6, "one event per new token"
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert runner.freed == [seq_id] and runner.kv == {}
    assert sched.kv_reserved == 0 and sched.num_running == sched.num_waiting == 0


def test_schedule_twice_without_update_is_an_error():
    sched = Scheduler(SchedulerConfig())
    sched.add_request(req("a", [1, 2]))
    sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()


def test_fcfs_admission_bounded_by_batch_size():
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=2)), FakeRunner()
    ids = [sched.add_request(req(f"r{i}", [i + 1] * 3, max_new_tokens=2 + i % 3)) for i in range(7)]
    events = run_all(sched, runner)
    assert admitted_order(runner) == ids
    assert max(b.batch_size for b in runner.batches) == 2
    for i in range(7):
        assert outputs(events)[f"r{i}"] == reference([i + 1] * 3, 2 + i % 3)


def test_token_budget_caps_every_step_and_chunks_prompts():
    cfg = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=10)
    sched, runner = Scheduler(cfg), FakeRunner()
    sched.add_request(req("a", list(range(1, 7)), max_new_tokens=3))
    sched.add_request(req("b", list(range(11, 17)), max_new_tokens=3))
    first = step(sched, runner)
    shape = [(c.seq_id, c.start, len(c.token_ids), c.is_last) for c in first.prefills]
    assert shape == [(0, 0, 6, True), (1, 0, 4, False)]
    second = step(sched, runner)
    assert [d.seq_id for d in second.decodes] == [0]
    assert [(c.seq_id, c.start, len(c.token_ids), c.is_last) for c in second.prefills] == [(1, 4, 2, True)]
    sched.add_request(req("c", list(range(30, 50)), max_new_tokens=3))
    third = step(sched, runner)
    assert len(third.decodes) == 2 and [len(c.token_ids) for c in third.prefills] == [8], "decodes take budget first"
    events = sched.pop_events() + run_all(sched, runner)
    assert all(b.num_tokens <= 10 for b in runner.batches)
    assert outputs(events) == {"a": reference(range(1, 7), 3), "b": reference(range(11, 17), 3),
                               "c": reference(range(30, 50), 3)}
    assert runner.kv == {}


def test_chunked_prefill_of_a_long_prompt():
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=2, max_num_batched_tokens=8)), FakeRunner()
    prompt = [random.Random(0).randrange(VOCAB) for _ in range(25)]
    sched.add_request(req("long", prompt, max_new_tokens=5))
    events = run_all(sched, runner)
    chunks = [c for b in runner.batches for c in b.prefills]
    shape = [(c.start, len(c.token_ids), c.is_last) for c in chunks]
    assert shape == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 1, True)]
    assert outputs(events)["long"] == reference(prompt, 5)


def test_without_chunking_a_prompt_is_fed_whole_or_waits():
    cfg = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched, runner = Scheduler(cfg), FakeRunner()
    sched.add_request(req("a", [1] * 6))
    sched.add_request(req("b", [2] * 6))
    sched.add_request(req("c", [3] * 2))
    first = step(sched, runner)
    assert [c.seq_id for c in first.prefills] == [0], "b does not fit; c may not overtake it (FCFS)"
    second = step(sched, runner)
    assert [(c.seq_id, len(c.token_ids)) for c in second.prefills] == [(1, 6), (2, 2)]
    with pytest.raises(RequestTooLongError) as err:
        sched.add_request(req("d", [1] * 11))
    assert err.value.limit == 10 and err.value.field == "prompt"
    events = run_all(sched, runner)
    assert all(len(c.token_ids) == 6 or c.seq_id == 2 for b in runner.batches for c in b.prefills)
    assert {rid for rid, (_, s) in outputs(events).items() if s is SequenceStatus.FINISHED_LENGTH} >= {"a", "b", "c"}


def test_kv_capacity_bounds_admission():
    capacity = [30]
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=8), kv_capacity=lambda: capacity[0]), FakeRunner()
    for i in range(4):  # each reserves 5 + 10 - 1 = 14 entries: two fit in 30
        sched.add_request(req(f"r{i}", [i + 1] * 5, max_new_tokens=10))
    first = step(sched, runner)
    assert len(first.prefills) == 2 and sched.kv_reserved == 28
    events = run_all(sched, runner)
    assert all(len(o) == 10 for o, _ in outputs(events).values())
    assert sched.kv_reserved == 0
    with pytest.raises(RequestTooLongError) as err:
        sched.add_request(req("big", [1] * 20, max_new_tokens=20))
    assert err.value.limit == 30


# -- queue delay ------------------------------------------------------------------------
def test_queue_delay_lets_a_batch_form():
    clock = FakeClock()
    cfg = SchedulerConfig(max_batch_size=4, max_queue_delay_ms=100)
    sched, runner = Scheduler(cfg, clock=clock), FakeRunner()
    sched.add_request(req("a", [1, 2]))
    assert not step(sched, runner).has_work, "one request waits for company"
    assert sched.next_wakeup() == pytest.approx(clock.t + 0.1)
    clock.advance(0.05)
    sched.add_request(req("b", [3, 4]))
    assert not step(sched, runner).has_work
    clock.advance(0.0499)
    assert not step(sched, runner).has_work
    clock.advance(0.0002)
    batch = step(sched, runner)
    assert [c.seq_id for c in batch.prefills] == [0, 1], "the oldest waited 100 ms: both go together"


def test_queue_delay_admits_at_once_when_the_batch_is_full():
    clock = FakeClock()
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=3, max_queue_delay_ms=1e6), clock=clock), FakeRunner()
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1]))
    assert len(step(sched, runner).prefills) == 3


def test_queue_delay_admits_at_once_when_draining():
    cfg = SchedulerConfig(max_batch_size=3, max_queue_delay_ms=1e6)
    sched, runner = Scheduler(cfg, clock=FakeClock()), FakeRunner()
    sched.add_request(req("a", [1]))
    assert not step(sched, runner).has_work
    sched.drain()
    assert len(step(sched, runner).prefills) == 1


# -- stop conditions ------------------------------------------------------------------
def test_eos_stops_and_ignore_eos_does_not():
    prompt = [3, 1, 4, 1, 5]
    full, _ = reference(prompt, 12)
    eos = full[4]
    sched, runner = Scheduler(SchedulerConfig(eos_token_ids=frozenset({eos}))), FakeRunner()
    sched.add_request(req("stops", prompt, max_new_tokens=12))
    sched.add_request(req("ignores", prompt, max_new_tokens=12, ignore_eos=True))
    out = outputs(run_all(sched, runner))
    assert out["stops"] == reference(prompt, 12, eos={eos})
    assert out["stops"][1] is SequenceStatus.FINISHED_STOPPED and out["stops"][0][-1] == eos
    assert out["ignores"] == (full, SequenceStatus.FINISHED_LENGTH)


def test_stop_token_sequences_and_max_model_len():
    prompt = [2, 7, 1, 8]
    full, _ = reference(prompt, 12)
    stop = tuple(full[3:5])
    sched, runner = Scheduler(SchedulerConfig(max_model_len=10)), FakeRunner()
    sched.add_request(req("stop", prompt, max_new_tokens=12, stop_token_ids=[list(stop), [VOCAB + 5]]))
    sched.add_request(req("capped", prompt, max_new_tokens=12))
    out = outputs(run_all(sched, runner))
    assert out["stop"] == reference(prompt, 12, stop_token_ids=[stop])
    assert out["stop"][1] is SequenceStatus.FINISHED_STOPPED
    assert out["capped"] == (full[:6], SequenceStatus.FINISHED_LENGTH), "prompt 4 + 6 new = max_model_len 10"
    with pytest.raises(RequestTooLongError):
        sched.add_request(req("too-long", [1] * 10))


def test_runner_tokens_after_a_stop_are_dropped():
    sched = Scheduler(SchedulerConfig(eos_token_ids=frozenset({0})))
    seq_id = sched.add_request(req("a", [1], max_new_tokens=10))
    sched.schedule()
    sched.update(RunnerOutput({seq_id: [5, 0, 6, 7]}))
    (event,) = sched.pop_events()
    assert event.token_ids == (5, 0) and event.status is SequenceStatus.FINISHED_STOPPED


def letters(ids) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_cut_the_text_and_never_leak_into_the_stream():
    prompt = [9, 9, 9]
    full, _ = reference(prompt, 20)
    text = letters(full)
    stop = text[6:9]
    cut = text.index(stop)
    sched, runner = Scheduler(SchedulerConfig(), detokenize=letters), FakeRunner()
    sched.add_request(req("s", prompt, max_new_tokens=20, stop=[stop, "#never#"]))
    events = run_all(sched, runner)
    pieces = [e.text for e in events]
    assert "".join(pieces) == text[:cut]
    assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))
    assert events[-1].status is SequenceStatus.FINISHED_STOPPED
    assert len(outputs(events)["s"][0]) == cut + len(stop), "tokens up to the one completing the stop string"


def test_stop_strings_need_a_detokenizer():
    with pytest.raises(InvalidRequestError) as err:
        Scheduler(SchedulerConfig()).add_request(req("s", [1], stop=["x"]))
    assert err.value.field == "stop"


def test_text_stream_holds_back_incomplete_utf8():
    def utf8(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    data = "héllo wörld €!".encode()
    stream, pieces = TextStream(utf8, ()), []
    for n in range(1, len(data) + 1):
        stream.extend(list(data[:n]))
        pieces.append(stream.release(final=False))
    pieces.append(stream.release(final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "héllo wörld €!"


def test_text_stream_flushes_a_dangling_partial_character_at_the_end():
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), ())
    stream.extend([104])
    stream.extend([104, 0xE2, 0x82])
    assert stream.release(final=False) == "h"
    stream.extend([104, 0xE2, 0x82], flush=True)
    assert stream.release(final=True) == "\ufffd"


# -- cancellation, deadlines, failures ------------------------------------------------
def test_cancel_frees_the_slot_for_the_next_request():
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=1)), FakeRunner()
    a = sched.add_request(req("a", [1, 2], max_new_tokens=100))
    b = sched.add_request(req("b", [3, 4], max_new_tokens=3))
    step(sched, runner)
    step(sched, runner)
    sched.pop_events()
    assert sched.cancel("a") and not sched.cancel("a") and not sched.cancel("nope")
    (event,) = sched.pop_events()
    assert event.request_id == "a" and event.status is SequenceStatus.CANCELLED
    batch = step(sched, runner)
    assert batch.freed_seq_ids == (a,) and [c.seq_id for c in batch.prefills] == [b]
    assert outputs(run_all(sched, runner))["b"] == reference([3, 4], 3)
    assert a not in runner.kv


def test_cancel_while_waiting_never_reaches_the_runner():
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=1)), FakeRunner()
    sched.add_request(req("a", [1]))
    b = sched.add_request(req("b", [2]))
    step(sched, runner)
    assert sched.cancel("b")
    run_all(sched, runner)
    assert b not in runner.freed and b not in admitted_order(runner)


def test_cancel_during_a_step_drops_its_tokens():
    sched, runner = Scheduler(SchedulerConfig()), FakeRunner()
    a = sched.add_request(req("a", [1, 2], max_new_tokens=5))
    batch = sched.schedule()
    sched.cancel("a")
    sched.update(runner.step(batch))
    events = sched.pop_events()
    assert [(e.token_ids, e.status) for e in events] == [((), SequenceStatus.CANCELLED)]
    assert sched.schedule().freed_seq_ids == (a,)


def test_deadline_expiry_frees_running_and_waiting_requests():
    clock = FakeClock()
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=1), clock=clock), FakeRunner()
    a = sched.add_request(req("a", [1], max_new_tokens=100, deadline=clock.t + 1.0))
    sched.add_request(req("b", [2], max_new_tokens=100, deadline=clock.t + 0.5))
    sched.add_request(req("c", [3], max_new_tokens=2))
    assert sched.next_wakeup() == pytest.approx(clock.t + 0.5)
    step(sched, runner)
    clock.advance(2.0)
    batch = step(sched, runner)
    assert batch.freed_seq_ids == (a,), "a ran, so the runner frees it; b never ran"
    assert [c.seq_id for c in batch.prefills] == [2]
    events = sched.pop_events()
    statuses = {e.request_id: e.status for e in events if e.finished}
    assert statuses == {"a": SequenceStatus.EXPIRED, "b": SequenceStatus.EXPIRED}
    assert outputs(events + run_all(sched, runner))["c"] == reference([3], 2)


def test_runner_failures_fail_only_their_sequences():
    sched = Scheduler(SchedulerConfig())
    a = sched.add_request(req("a", [1]))
    b = sched.add_request(req("b", [2]))
    sched.schedule()
    sched.update(RunnerOutput({b: [4]}, failed={a: "boom"}))
    events = {e.request_id: e for e in sched.pop_events()}
    assert events["a"].status is SequenceStatus.FAILED and events["a"].error == "boom"
    assert events["b"].status is SequenceStatus.RUNNING and events["b"].token_ids == (4,)
    batch = sched.schedule()
    assert batch.freed_seq_ids == (a,) and [d.seq_id for d in batch.decodes] == [b]
    sched.abort_step("device lost")
    (event,) = sched.pop_events()
    assert event.status is SequenceStatus.FAILED and event.error == "device lost"
    assert not sched.has_unfinished


def test_a_missing_token_fails_the_sequence():
    sched = Scheduler(SchedulerConfig())
    sched.add_request(req("a", [1]))
    sched.schedule()
    sched.update(RunnerOutput({}))
    (event,) = sched.pop_events()
    assert event.status is SequenceStatus.FAILED and "no token" in event.error


# -- admission control ------------------------------------------------------------------
def test_queue_full_raises_at_once_and_every_accepted_request_completes():
    rec = Recorder()
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=2, max_queue_size=3), observer=rec), FakeRunner()
    accepted, refused = [], 0
    for i in range(10):
        try:
            sched.add_request(req(f"r{i}", [i + 1, i + 2], max_new_tokens=3))
            accepted.append(f"r{i}")
        except QueueFullError:
            refused += 1
        if i == 5:
            step(sched, runner)  # admits two: room for two more
    assert accepted == ["r0", "r1", "r2", "r6", "r7"] and refused == 5
    assert rec.rejected == ["queue_full"] * 5
    out = outputs(run_all(sched, runner))
    assert sorted(out) == sorted(accepted)
    assert all(status is SequenceStatus.FINISHED_LENGTH and len(t) == 3 for t, status in out.values())


def test_drain_refuses_new_requests_and_finishes_accepted_ones():
    rec = Recorder()
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=1), observer=rec), FakeRunner()
    sched.add_request(req("a", [1], max_new_tokens=3))
    sched.add_request(req("b", [2], max_new_tokens=3))
    step(sched, runner)
    sched.drain()
    with pytest.raises(DrainingError):
        sched.add_request(req("c", [3]))
    out = outputs(run_all(sched, runner))
    assert set(out) == {"a", "b"} and all(s is SequenceStatus.FINISHED_LENGTH for _, s in out.values())
    assert rec.rejected == ["draining"] and not sched.accepting


def test_bad_requests_name_the_field():
    cases = {
        "temperature": lambda: SamplingParams(temperature=-1),
        "top_k": lambda: SamplingParams(top_k=-1),
        "top_p": lambda: SamplingParams(top_p=0.0),
        "seed": lambda: SamplingParams(seed=2**64),
        "max_new_tokens": lambda: SamplingParams(max_new_tokens=0),
        "stop_token_ids": lambda: SamplingParams(stop_token_ids=[[]]),
        "stop": lambda: SamplingParams(stop=[""]),
        "prompt": lambda: Request(request_id="x", prompt_token_ids=[]),
        "request_id": lambda: Request(request_id="", prompt_token_ids=[1]),
    }
    for field, make in cases.items():
        with pytest.raises(InvalidRequestError) as err:
            make()
        assert err.value.field == field and err.value.grpc_status == "INVALID_ARGUMENT"
    with pytest.raises(InvalidRequestError):
        Request(request_id="x", prompt_token_ids=[1, -2])


def test_duplicate_request_ids_are_refused_while_in_flight():
    sched, runner = Scheduler(SchedulerConfig()), FakeRunner()
    sched.add_request(req("a", [1], max_new_tokens=1))
    with pytest.raises(DuplicateRequestError):
        sched.add_request(req("a", [2]))
    run_all(sched, runner)
    sched.add_request(req("a", [2]))  # finished ids can be reused


# -- statistics -------------------------------------------------------------------------
def test_stats_report_queue_time_first_token_and_inter_token_latency():
    clock, rec = FakeClock(), Recorder()
    sched, runner = Scheduler(SchedulerConfig(max_batch_size=2), clock=clock, observer=rec), FakeRunner()
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1] * 4, max_new_tokens=5))
    run_all(sched, runner, clock)  # every step takes 10 ms
    queue = sorted(q for s in rec.steps for q in s.queue_times)
    assert queue == pytest.approx([0.0, 0.0, 0.05])  # r2 waits for r0's 5 steps
    ttft = [t for s in rec.steps for t in s.times_to_first_token]
    itl = [t for s in rec.steps for t in s.inter_token_latencies]
    assert sorted(ttft) == pytest.approx([0.01, 0.01, 0.06])
    assert len(itl) == 3 * 4 and itl == pytest.approx([0.01] * 12)
    assert sum(s.num_generated_tokens for s in rec.steps) == 15
    assert sum(s.num_prefill_tokens for s in rec.steps) == 12
    assert [s.batch_size for s in rec.steps] == [2, 2, 2, 2, 2, 1, 1, 1, 1, 1]
    assert [f.status for f in rec.finished] == ["length"] * 3
    assert rec.finished[-1].e2e_latency == pytest.approx(0.1)
    assert [len(f.inter_token_latencies) for f in rec.finished] == [4, 4, 4]
    assert rec.finished[-1].inter_token_latencies == pytest.approx([0.01] * 4)
    assert rec.queue[-1] == (0, 0)


def test_prefill_cap_applies_only_while_sequences_decode():
    cfg = SchedulerConfig(max_batch_size=16, max_num_batched_tokens=64, max_prefill_tokens_per_step=4)
    sched, runner = Scheduler(cfg), FakeRunner()
    sched.add_request(req("a", list(range(1, 11)), max_new_tokens=8))
    first = step(sched, runner)
    assert [len(c.token_ids) for c in first.prefills] == [10], "nothing decodes: the whole budget"
    sched.add_request(req("b", list(range(20, 30)), max_new_tokens=3))
    sched.add_request(req("c", [7, 8], max_new_tokens=3))
    while sched.num_waiting or any(b.prefills for b in runner.batches[-1:]):
        batch = step(sched, runner)
        if batch.decodes:
            assert batch.num_prefill_tokens <= 4, "capped while a sequence decodes"
    chunks = [(c.seq_id, c.start, len(c.token_ids)) for b in runner.batches[1:] for c in b.prefills]
    assert chunks[:3] == [(1, 0, 4), (1, 4, 4), (1, 8, 2)] and (2, 0, 2) in chunks[2:4]
    events = sched.pop_events() + run_all(sched, runner)
    assert outputs(events)["b"] == reference(range(20, 30), 3) and outputs(events)["c"] == reference([7, 8], 3)
    # a backlog lifts the cap: admitting fast beats even gaps
    sched, runner = Scheduler(cfg), FakeRunner()
    sched.add_request(req("a", [1, 2], max_new_tokens=8))
    step(sched, runner)
    for i in range(5):
        sched.add_request(req(f"q{i}", list(range(30, 40)), max_new_tokens=2))
    assert step(sched, runner).num_prefill_tokens == 50, "5 waiting > 16 / 8: every prompt whole"
    events = sched.pop_events() + run_all(sched, runner)
    assert all(outputs(events)[f"q{i}"] == reference(range(30, 40), 2) for i in range(5))
    narrow = Scheduler(SchedulerConfig(max_batch_size=4, max_num_batched_tokens=64, max_prefill_tokens_per_step=4))
    runner = FakeRunner()
    narrow.add_request(req("a", [1, 2], max_new_tokens=8))
    step(narrow, runner)
    for i in range(4):
        narrow.add_request(req(f"q{i}", list(range(30, 40)), max_new_tokens=2))
    assert step(narrow, runner).num_prefill_tokens == 30, "4 waiting > 3 free slots: three whole prompts"
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step"):
        SchedulerConfig(max_prefill_tokens_per_step=0)


def test_prefill_pacing_spreads_pending_prompt_tokens_under_the_cap():
    """[Note: prefill pacing]: while sequences decode, a step feeds pending prompt tokens / pacing steps (at least
    PACING_MIN_CHUNK, at most the cap); more pending raises the allowance; nothing decoding: the whole budget."""
    from zspeed.serve.scheduler import PACING_MIN_CHUNK

    assert PACING_MIN_CHUNK == 32
    cfg = SchedulerConfig(max_batch_size=16, max_num_batched_tokens=512, max_prefill_tokens_per_step=96,
                          prefill_pacing_steps=4)
    sched, runner = Scheduler(cfg), FakeRunner()
    sched.add_request(req("a", [1, 2], max_new_tokens=40))
    step(sched, runner)
    sched.add_request(req("b", list(range(1, 129)), max_new_tokens=2))  # a lone 128-token prompt
    sizes = []
    while not sizes or runner.batches[-1].prefills:
        sizes.append(step(sched, runner).num_prefill_tokens)
    assert sizes[:-1] == [32, 32, 32, 32], "128 / 4 steps: four chunks of 32"
    sched.add_request(req("c", list(range(1, 201)), max_new_tokens=2))
    sched.add_request(req("d", list(range(1, 201)), max_new_tokens=2))
    assert step(sched, runner).num_prefill_tokens == 96, "400 pending / 4 = 100: the cap"
    assert step(sched, runner).num_prefill_tokens == 76, "304 pending / 4"
    assert step(sched, runner).num_prefill_tokens == 57, "228 pending / 4, rounded up"
    events = sched.pop_events() + run_all(sched, runner)
    out = outputs(events)
    assert out["b"] == reference(range(1, 129), 2) and out["c"] == out["d"] == reference(range(1, 201), 2)
    idle = Scheduler(cfg)
    idle.add_request(req("e", list(range(1, 301)), max_new_tokens=2))
    assert step(idle, FakeRunner()).num_prefill_tokens == 300, "nothing decodes: no cap, no pacing"
    unpaced = Scheduler(SchedulerConfig(max_batch_size=16, max_num_batched_tokens=512, max_prefill_tokens_per_step=96))
    runner = FakeRunner()
    unpaced.add_request(req("a", [1, 2], max_new_tokens=8))
    step(unpaced, runner)
    unpaced.add_request(req("b", list(range(1, 129)), max_new_tokens=2))
    assert step(unpaced, runner).num_prefill_tokens == 96, "without pacing: the whole cap"
    with pytest.raises(ValueError, match="prefill_pacing_steps must be >= 1"):
        SchedulerConfig(prefill_pacing_steps=0)


# -- invariants under random load -------------------------------------------------------------
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_load_keeps_every_limit_and_every_output_exact(seed, chunked):
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_batch_size=rng.randint(1, 6), max_num_batched_tokens=rng.randint(6, 24),
                          max_queue_size=8, enable_chunked_prefill=chunked, max_model_len=40)
    capacity = 60
    sched, runner = Scheduler(cfg, kv_capacity=lambda: capacity), FakeRunner()
    expected, events, cancelled = {}, [], set()
    for i in range(60):
        if rng.random() < 0.6:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, cfg.max_num_batched_tokens))]
            n = rng.randint(1, 12)
            try:
                sched.add_request(req(f"r{i}", prompt, max_new_tokens=n))
                expected[f"r{i}"] = reference(prompt, min(n, 40 - len(prompt)))
            except QueueFullError:
                pass
        if expected and rng.random() < 0.05:
            victim = rng.choice(sorted(expected))
            if sched.cancel(victim):
                cancelled.add(victim)
        batch = step(sched, runner)
        events += sched.pop_events()
        assert batch.batch_size <= cfg.max_batch_size and batch.num_tokens <= cfg.max_num_batched_tokens
        assert sched.kv_reserved <= capacity
    events += run_all(sched, runner)
    out = outputs(events)
    for rid, (tokens, status) in out.items():
        if rid in cancelled:
            assert status is SequenceStatus.CANCELLED and tokens == expected[rid][0][: len(tokens)]
        else:
            assert (tokens, status) == expected[rid]
    assert set(out) == set(expected) and runner.kv == {} and sched.kv_reserved == 0


def test_scheduler_and_engine_loop_import_no_torch():
    code = (
        "import sys\n"
        "import zspeed.serve.scheduler, zspeed.serve.engine_loop, zspeed.serve.request, zspeed.serve.sequence\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
