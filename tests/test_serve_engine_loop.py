"""The engine loop in its thread, with a fake runner; and the generated gRPC stubs over a real channel."""
from __future__ import annotations

import filecmp
import pathlib
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest

from zspeed.serve.engine_loop import EngineLoop
from zspeed.serve.errors import DrainingError, EngineStoppedError, QueueFullError
from zspeed.serve.request import Request, SamplingParams
from zspeed.serve.scheduler import RunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from zspeed.serve.sequence import SequenceStatus

VOCAB = 101
SERVE_DIR = pathlib.Path(__file__).resolve().parents[1] / "serve"


def next_token(tokens) -> int:
    return (sum((i + 3) * t for i, t in enumerate(tokens)) * 17 + len(tokens)) % VOCAB


def reference(prompt, n) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    """Next token = f(sequence so far). ``gate`` (when set) must be open for a step to run."""

    def __init__(self, *, step_seconds: float = 0.0, fail_seq: int | None = None) -> None:
        self.kv: dict[int, list[int]] = {}
        self.freed: list[int] = []
        self.step_seconds = step_seconds
        self.fail_seq = fail_seq
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0
        self.thread_ids: set[int] = set()

    def step(self, batch: SchedulerOutput) -> RunnerOutput:
        self.thread_ids.add(threading.get_ident())
        assert self.gate.wait(10), "test gate never opened"
        time.sleep(self.step_seconds)
        self.steps += 1
        if self.fail_seq is not None and any(c.seq_id == self.fail_seq for c in batch.prefills):
            self.fail_seq = None
            raise RuntimeError("injected failure")
        out = {}
        for chunk in batch.prefills:
            kv = self.kv.setdefault(chunk.seq_id, [])
            assert chunk.start == len(kv)
            kv.extend(chunk.token_ids)
            if chunk.is_last:
                out[chunk.seq_id] = [next_token(kv)]
        for item in batch.decodes:
            self.kv[item.seq_id].append(item.token_id)
            out[item.seq_id] = [next_token(self.kv[item.seq_id])]
        return RunnerOutput(out)

    def free(self, seq_id: int) -> None:
        self.freed.append(seq_id)
        self.kv.pop(seq_id, None)


def req(rid, prompt, n=5, deadline=None) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(max_new_tokens=n),
                   deadline=deadline)


def engine(runner, **cfg) -> EngineLoop:
    cfg.setdefault("max_batch_size", 4)
    return EngineLoop(Scheduler(SchedulerConfig(**cfg)), runner)


def wait_until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def test_generate_and_stream_in_order():
    runner = FakeRunner()
    with engine(runner) as loop:
        result = loop.generate(req("a", [1, 2, 3], n=8), timeout=5)
        handle = loop.submit(req("b", [4, 5], n=6))
        events = list(handle.stream(timeout=5))
    assert result.token_ids == tuple(reference([1, 2, 3], 8)) and result.status is SequenceStatus.FINISHED_LENGTH
    assert result.prompt_tokens == 3
    assert [t for e in events for t in e.token_ids] == reference([4, 5], 6)
    assert len(events) == 6 and events[-1].finished and not any(e.finished for e in events[:-1])
    assert handle.result(0).token_ids == tuple(reference([4, 5], 6))
    assert len(runner.thread_ids) == 1 and threading.get_ident() not in runner.thread_ids


def test_tokens_stream_before_the_request_finishes():
    runner = FakeRunner(step_seconds=0.005)
    with engine(runner) as loop:
        handle = loop.submit(req("a", [7], n=60))
        stream = handle.stream(timeout=5)
        first = next(stream)
        assert not handle.done(), "the first token arrives while generation goes on"
        rest = list(stream)
    assert [t for e in [first, *rest] for t in e.token_ids] == reference([7], 60)


def test_concurrent_clients_from_many_threads_get_exact_outputs():
    runner = FakeRunner()
    results: dict[str, tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def client(k: int, loop: EngineLoop) -> None:
        try:
            for j in range(5):
                prompt = [(k * 7 + j) % VOCAB + 1] * (1 + (k + j) % 9)
                handle = loop.submit(req(f"c{k}-{j}", prompt, n=1 + (k * j) % 11))
                streamed = [t for e in handle.stream(timeout=10) for t in e.token_ids]
                assert tuple(streamed) == handle.result(0).token_ids
                results[handle.request_id] = (tuple(prompt), handle.result(0).token_ids)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with engine(runner, max_batch_size=6, max_num_batched_tokens=16, max_queue_size=64) as loop:
        threads = [threading.Thread(target=client, args=(k, loop)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert not errors, errors
    assert len(results) == 40
    for prompt, tokens in results.values():
        assert list(tokens) == reference(prompt, len(tokens)) and len(tokens) >= 1
    wait_until(lambda: runner.kv == {})


def test_cancel_from_the_client_frees_the_slot():
    runner = FakeRunner(step_seconds=0.002)
    with engine(runner, max_batch_size=1) as loop:
        long = loop.submit(req("long", [1], n=10_000))
        short = loop.submit(req("short", [2], n=3))
        next(long.stream(timeout=5))
        assert long.cancel() and not long.cancel()
        assert long.result(5).status is SequenceStatus.CANCELLED
        assert short.result(5).token_ids == tuple(reference([2], 3))
        wait_until(lambda: 0 in runner.freed)


def test_queue_full_is_immediate_and_every_accepted_request_completes():
    runner = FakeRunner()
    runner.gate.clear()  # the first step blocks: nothing leaves the queue
    with engine(runner, max_batch_size=2, max_queue_size=3) as loop:
        accepted = [loop.submit(req("r0", [1], n=4))]
        wait_until(lambda: runner.thread_ids)  # r0's step is in the runner
        refusals = []
        for i in range(1, 10):
            try:
                accepted.append(loop.submit(req(f"r{i}", [i + 1], n=4)))
            except QueueFullError:
                start = time.monotonic()
                with pytest.raises(QueueFullError):
                    loop.submit(req(f"again{i}", [1]))
                refusals.append(time.monotonic() - start)
        assert len(accepted) == 4 and len(refusals) == 6
        assert max(refusals) < 0.5, "refused at once, not after waiting for room (the runner is blocked)"
        runner.gate.set()
        results = [h.result(5) for h in accepted]
    assert all(r.status is SequenceStatus.FINISHED_LENGTH for r in results)
    assert [list(r.token_ids) for r in results] == [reference([i + 1], 4) for i in range(4)]


def test_drain_refuses_new_requests_and_finishes_running_ones():
    runner = FakeRunner(step_seconds=0.002)
    loop = engine(runner, max_batch_size=2).start()
    handles = [loop.submit(req(f"r{i}", [i + 1], n=5)) for i in range(4)]
    drained: list[bool] = []
    drainer = threading.Thread(target=lambda: drained.append(loop.drain(timeout=10)))
    drainer.start()
    wait_until(lambda: not loop.accepting)
    with pytest.raises(DrainingError):
        loop.submit(req("late", [9]))
    drainer.join(10)
    assert drained == [True]
    assert all(h.done() and h.result(0).status is SequenceStatus.FINISHED_LENGTH for h in handles)
    loop.stop()
    with pytest.raises(EngineStoppedError):
        loop.submit(req("after-stop", [9]))


def test_deadline_expires_a_running_request():
    runner = FakeRunner(step_seconds=0.002)
    with engine(runner) as loop:
        handle = loop.submit(req("slow", [1], n=100_000, deadline=loop.now() + 0.05))
        result = handle.result(5)
        assert result.status is SequenceStatus.EXPIRED and len(result.token_ids) > 0
        wait_until(lambda: 0 in runner.freed)


def test_deadline_expires_a_request_waiting_in_an_idle_queue():
    runner = FakeRunner()
    loop = EngineLoop(Scheduler(SchedulerConfig(max_queue_delay_ms=60_000)), runner)
    with loop:
        handle = loop.submit(req("w", [1], deadline=loop.now() + 0.05))
        assert handle.result(2).status is SequenceStatus.EXPIRED
    assert runner.steps == 0


def test_runner_failure_fails_its_batch_and_the_loop_goes_on():
    runner = FakeRunner(fail_seq=0)
    with engine(runner) as loop:
        failed = loop.submit(req("bad", [1], n=3)).result(5)
        ok = loop.generate(req("good", [2], n=3), timeout=5)
    assert failed.status is SequenceStatus.FAILED and "injected failure" in failed.error
    assert ok.token_ids == tuple(reference([2], 3))
    assert 0 in runner.freed


def test_stop_fails_what_is_unfinished():
    runner = FakeRunner()
    runner.gate.clear()
    loop = engine(runner).start()
    handles = [loop.submit(req(f"r{i}", [1], n=3)) for i in range(3)]
    wait_until(lambda: runner.thread_ids)
    threading.Timer(0.05, runner.gate.set).start()
    loop.stop(timeout=5)
    assert all(h.result(1).status is SequenceStatus.FAILED for h in handles)


# -- the generated gRPC stubs ---------------------------------------------------------------
def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", str(SERVE_DIR / "proto" / "gen.sh"), str(tmp_path)], check=True, capture_output=True)
    names = ["__init__.py", "serve_pb2.py", "serve_pb2.pyi", "serve_pb2_grpc.py"]
    match, mismatch, missing = filecmp.cmpfiles(tmp_path, SERVE_DIR / "_proto", names, shallow=False)
    assert match == names, f"regenerate with serve/proto/gen.sh: {mismatch + missing}"


def test_stubs_serve_generate_and_stream_over_grpc():
    from zspeed.serve._proto import serve_pb2, serve_pb2_grpc

    service = serve_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "zspeed.serve.v1.GenerationService"
    assert [m.name for m in service.methods] == ["Generate", "GenerateStream", "ModelInfo"]

    class Servicer(serve_pb2_grpc.GenerationServiceServicer):  # the thinnest adapter over the engine
        def __init__(self, loop):
            self.loop = loop

        def _submit(self, msg, context):
            handle = self.loop.submit(req(msg.request_id, list(msg.token_ids.ids), n=msg.max_new_tokens))
            context.add_callback(handle.cancel)
            return handle

        def GenerateStream(self, msg, context):
            for event in self._submit(msg, context):
                reason = serve_pb2.FINISH_REASON_LENGTH if event.finished else serve_pb2.FINISH_REASON_UNSPECIFIED
                yield serve_pb2.GenerateStreamResponse(request_id=event.request_id, token_ids=event.token_ids,
                                                       finish_reason=reason)

        def Generate(self, msg, context):
            result = self._submit(msg, context).result()
            return serve_pb2.GenerateResponse(request_id=result.request_id, token_ids=result.token_ids,
                                              usage=serve_pb2.Usage(prompt_tokens=result.prompt_tokens,
                                                                    completion_tokens=len(result.token_ids)))

    runner = FakeRunner()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    with engine(runner) as loop:
        serve_pb2_grpc.add_GenerationServiceServicer_to_server(Servicer(loop), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = serve_pb2_grpc.GenerationServiceStub(channel)
                ask = serve_pb2.GenerateRequest(request_id="x", token_ids=serve_pb2.TokenIds(ids=[3, 4]),
                                                max_new_tokens=5)
                chunks = list(stub.GenerateStream(ask, timeout=10))
                whole = stub.Generate(serve_pb2.GenerateRequest(request_id="y", token_ids=ask.token_ids,
                                                                max_new_tokens=5), timeout=10)
        finally:
            server.stop(None)
    assert [t for c in chunks for t in c.token_ids] == reference([3, 4], 5)
    assert [c.finish_reason for c in chunks][-1] == serve_pb2.FINISH_REASON_LENGTH
    assert list(whole.token_ids) == reference([3, 4], 5) and whole.usage.completion_tokens == 5


def test_step_log_and_sink_mode(tmp_path):
    """``step_log`` writes a line per step; with a sink, events go there in order and submit is refused."""
    import json

    events = []
    log = tmp_path / "steps.jsonl"
    loop = EngineLoop(Scheduler(SchedulerConfig(max_batch_size=4)), FakeRunner(), sink=events.extend,
                      step_log=str(log))
    with loop:
        with pytest.raises(RuntimeError, match="enqueue"):
            loop.submit(req("x", [1]))
        loop.enqueue(req("a", [1, 2, 3], n=4))
        wait_until(lambda: any(e.finished for e in events))
    assert [t for e in events for t in e.token_ids] == reference([1, 2, 3], 4)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and steps[0]["prefill_tokens"] == 3
    assert all(s["decodes"] == 1 and s["runner_s"] >= 0 and s["runner_cpu_s"] >= 0 for s in steps[1:])
    with pytest.raises(RuntimeError, match="sink"):
        engine(FakeRunner()).enqueue(req("y", [1]))
