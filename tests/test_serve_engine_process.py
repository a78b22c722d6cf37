"""The engine in its own process ([Note: engine process]): same results, errors and metrics as in one process,
and a dead engine fails its requests instead of hanging them."""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time

import grpc
import pytest

from tests.serve_cases import PROMPTS, check_concurrent_requests, scrape, status_of, wait_until
from zspeed.serve import Client
from zspeed.serve.errors import QueueFullError, RequestTooLongError
from zspeed.serve.model_loader import LoadConfig
from zspeed.serve.server import ServerConfig, create_process_server


@contextlib.contextmanager
def process_server(model_dir, *, offload: str = "none", **config):
    config = {"port": 0, "metrics_port": 0, "max_batch_size": 4, "max_num_batched_tokens": 32, **config}
    load = LoadConfig(model=str(model_dir), device="cpu", progress=False, offload=offload)
    server = create_process_server(load, ServerConfig(**config)).start()
    try:
        yield server
    finally:
        server.stop(grace=0)




def test_serve_errors_survive_pickling():
    """Refusals cross the pipe as the same error, fields and gRPC status included."""
    err = pickle.loads(pickle.dumps(RequestTooLongError("prompt", "600 tokens", limit=511)))
    assert type(err) is RequestTooLongError and str(err) == "prompt: 600 tokens (limit 511)"
    assert (err.field, err.limit, err.grpc_status) == ("prompt", 511, "OUT_OF_RANGE")
    assert type(pickle.loads(pickle.dumps(QueueFullError("full")))) is QueueFullError


def test_results_streams_and_metrics_match_one_process(tiny_dir, reference):
    with process_server(tiny_dir, offload="cpu", max_prompt_tokens=100) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        assert server.engine._process.pid != os.getpid() and server.engine.alive
        assert client.model_info().offload == "cpu" and client.health() == "SERVING"
        check_concurrent_requests(client, reference)
        pieces = list(client.generate_stream(PROMPTS[3], max_new_tokens=12, ignore_eos=True))
        assert len(pieces) > 1 and pieces[-1].finish_reason == "length"
        assert tuple(t for p in pieces for t in p.token_ids) == reference.greedy(PROMPTS[3], 12, ignore_eos=True)
        code, detail = status_of(lambda: client.generate([1] * 101))
        assert code == grpc.StatusCode.OUT_OF_RANGE and "limit 100" in detail
        m = scrape(server)  # observations made in the engine process, counted in this one
    generated = sum(10 + 3 * i for i in range(len(PROMPTS))) + 12
    assert m[("zspeed_requests_total", (("status", "length"),))] == len(PROMPTS) + 1
    assert m[("zspeed_requests_total", (("status", "invalid"),))] == 1
    assert m[("zspeed_generation_tokens_total", ())] == generated
    assert m[("zspeed_time_to_first_token_seconds_count", ())] == len(PROMPTS) + 1
    assert m[("zspeed_weight_stream_bytes_total", ())] > 0
    assert m[("zspeed_requests_running", ())] == 0 and m[("zspeed_requests_waiting", ())] == 0


def test_queue_full_is_refused_with_its_status(tiny_dir):
    """A refusal raised in the engine process reaches the client as RESOURCE_EXHAUSTED, at once."""
    with process_server(tiny_dir, max_batch_size=1, max_queue_size=1, max_new_tokens=4000) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        running = client.generate_stream(PROMPTS[0], max_new_tokens=500, ignore_eos=True)
        next(running)  # admitted and generating
        waited: list = []
        waiting = threading.Thread(target=lambda: waited.extend(
            client.generate_stream(PROMPTS[2], max_new_tokens=3, ignore_eos=True)))
        waiting.start()
        assert wait_until(lambda: scrape(server)[("zspeed_requests_waiting", ())] == 1, timeout=30)
        code, detail = status_of(lambda: client.generate(PROMPTS[4], max_new_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_size" in detail
        assert sum(len(p.token_ids) for p in running) == 499, "the running request completes"
        waiting.join(60)
        assert sum(len(p.token_ids) for p in waited) == 3, "so does the queued one"


def test_a_dead_engine_fails_requests_instead_of_hanging_them(tiny_dir):
    with process_server(tiny_dir, max_batch_size=1, max_new_tokens=4000) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        stream = client.generate_stream(PROMPTS[1], max_new_tokens=3000, ignore_eos=True)
        next(stream)
        os.kill(server.engine._process.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "engine process exited" in info.value.details()
        assert not server.engine.alive and not server.engine.accepting
        code, detail = status_of(lambda: client.generate([5], max_new_tokens=2))
        assert code == grpc.StatusCode.UNAVAILABLE and "engine process exited" in detail


def test_a_model_that_does_not_load_raises_in_the_caller(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises((ValueError, OSError, RuntimeError)) as info:
        create_process_server(LoadConfig(model=str(tmp_path), device="cpu", progress=False), ServerConfig(port=0))
    assert "config" in str(info.value).lower()


def test_the_child_is_waited_for_by_one_thread_at_a_time():
    """The pipe's receiver and ``stop`` both wait for the child. In ``Process.join`` at once, the thread whose
    ``waitpid`` lost the race saw the exited child as running, so ``stop`` warned of a hang and killed it."""
    from zspeed.serve.engine_process import EngineProcess

    inside, most = [0], [0]

    class Child:
        def join(self, timeout):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            inside[0] -= 1

        def is_alive(self):
            return False

    engine = EngineProcess.__new__(EngineProcess)  # only the waiting, without a real child
    engine._process, engine._join_lock = Child(), threading.Lock()
    waiters = [threading.Thread(target=engine._join, args=(1.0,)) for _ in range(4)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    assert most[0] == 1
