"""The gRPC server end to end on loopback, with the tiny Llama: results, errors, security, operations."""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.serve_cases import PROMPTS, check_concurrent_requests, load_tiny, scrape, status_of, wait_until
from zspeed.serve import Client
from zspeed.serve._proto import serve_pb2, serve_pb2_grpc
from zspeed.serve.cli import main as zserve_main
from zspeed.serve.client import build_request
from zspeed.serve.server import SERVICE_NAME, ServerConfig, create_server

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]


class SlowRunner:
    """Wraps the model runner: each step takes at least ``delay`` seconds; records frees."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.freed: list[int] = []

    def step(self, batch):
        time.sleep(self.delay)
        return self.inner.step(batch)

    def free(self, seq_id: int) -> None:
        self.freed.append(seq_id)
        self.inner.free(seq_id)


@contextlib.contextmanager
def running_server(model_dir, *, delay: float | None = None, offload: str = "none", nvme_path: str | None = None,
                   **config):
    config = {"port": 0, "metrics_port": 0, "max_batch_size": 4, "max_num_batched_tokens": 32, **config}
    wrap = (lambda runner: SlowRunner(runner, delay)) if delay is not None else None
    model = load_tiny(model_dir, offload=offload, nvme_path=nvme_path)
    server = create_server(model, ServerConfig(**config), wrap_runner=wrap).start()
    try:
        yield server
    finally:
        server.stop(grace=0)


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_server(tiny_dir, max_prompt_tokens=100, max_new_tokens=64) as s:
        yield s


@pytest.fixture()
def client(server):
    with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c




# -- results -----------------------------------------------------------------------------------------------------
def test_generate_matches_hf(client, reference):
    result = client.generate(PROMPTS[1], max_new_tokens=24)
    assert result.token_ids == reference.greedy(PROMPTS[1], 24)
    assert result.finish_reason == "length"
    assert (result.prompt_tokens, result.completion_tokens) == (len(PROMPTS[1]), 24)


def test_concurrent_requests_of_different_lengths_match_hf(client, reference):
    check_concurrent_requests(client, reference)


def test_cuda_graphs_option_reaches_the_runner(tiny_dir, reference):
    """``ServerConfig.cuda_graphs`` (zserve --cuda-graphs): the runner splits its layers (eagerly on a CPU)."""
    with running_server(tiny_dir, cuda_graphs=True) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        assert server.engine._runner._pieces is not None
        check_concurrent_requests(client, reference)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offloaded_server_matches_hf(tiny_dir, reference, tmp_path, offload):
    with running_server(tiny_dir, offload=offload, nvme_path=str(tmp_path / "nvme")) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        assert client.model_info().offload == offload
        assert client.generate(PROMPTS[1], max_new_tokens=24).token_ids == reference.greedy(PROMPTS[1], 24)
        check_concurrent_requests(client, reference)


def test_stream_delivers_tokens_in_order(client, reference):
    pieces = list(client.generate_stream(PROMPTS[3], max_new_tokens=20, ignore_eos=True))
    tokens = [t for p in pieces for t in p.token_ids]
    assert tuple(tokens) == reference.greedy(PROMPTS[3], 20, ignore_eos=True)
    assert len(pieces) >= 20, "one message per step"
    assert all(p.finish_reason == "" for p in pieces[:-1]) and pieces[-1].finish_reason == "length"
    assert pieces[-1].completion_tokens == 20 and pieces[0].completion_tokens == 0
    whole = client.generate(PROMPTS[3], max_new_tokens=20, ignore_eos=True)
    assert "".join(p.text for p in pieces) == whole.text


def test_text_prompt_and_stop_string(client):
    full = client.generate("Hello", max_new_tokens=30, ignore_eos=True)
    assert full.prompt_tokens == 5  # byte tokenizer
    stop = next((full.text[i:i + 2] for i in range(3, len(full.text) - 2) if "\ufffd" not in full.text[i:i + 2]),
                None)
    assert stop, full.text
    cut = client.generate("Hello", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]


def test_model_info_health_and_reflection(server, client):
    info = client.model_info()
    assert (info.architecture, info.vocab_size, info.num_layers, info.offload) == ("llama", 256, 3, "none")
    assert (info.max_prompt_tokens, info.max_new_tokens, info.max_model_len, list(info.eos_token_ids)) == \
        (100, 64, 512, [2])
    assert client.health() == "SERVING" and client.health(SERVICE_NAME) == "SERVING"
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(db.get_services())
        assert db.FindFileContainingSymbol(SERVICE_NAME).name == "zspeed/serve/v1/serve.proto"


def test_zserve_refuses_a_negative_prefill_cap_or_pacing(capsys):
    assert zserve_main(["--model", "tiny", "--random-weights", "--max-prefill-tokens-per-step", "-1"]) == 2
    assert "--max-prefill-tokens-per-step must be >= 0 (0: no cap), got -1" in capsys.readouterr().err
    assert zserve_main(["--model", "tiny", "--random-weights", "--prefill-pacing-steps", "-2"]) == 2
    assert "--prefill-pacing-steps must be >= 0 (0: no pacing), got -2" in capsys.readouterr().err


def test_zserve_query_command(server, reference, capsys):
    assert zserve_main(["query", "--port", str(server.port), "--token-ids", "5 6 7", "--max-new-tokens", "6",
                        "--show-tokens"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == " ".join(map(str, reference.greedy([5, 6, 7], 6)))
    assert "[length: 3 prompt + 6 generated tokens]" in out.err


# -- bad requests --------------------------------------------------------------------------------------------------
BAD = [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ({"token_ids": serve_pb2.TokenIds()}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ({"token_ids": serve_pb2.TokenIds(ids=[5, 300])}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ({"token_ids": serve_pb2.TokenIds(ids=[-1])}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ({"text": "a", "sampling": serve_pb2.SamplingParams(temperature=-1)}, grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    ({"text": "a", "sampling": serve_pb2.SamplingParams(top_p=1.5)}, grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_p"),
    ({"text": "a", "stop": [""]}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ({"text": "a", "stop_token_ids": [serve_pb2.TokenIds()]}, grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    ({"text": "a" * 101}, grpc.StatusCode.OUT_OF_RANGE, "prompt: 101 tokens (limit 100)"),
    ({"text": "a", "max_new_tokens": 65}, grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens: 65 requested (limit 64)"),
]


@pytest.mark.parametrize("fields,code,detail", BAD, ids=[b[2].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_name_the_field(server, fields, code, detail):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = serve_pb2_grpc.GenerationServiceStub(channel)
        for rpc in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
            got_code, got_detail = status_of(lambda: rpc(serve_pb2.GenerateRequest(**fields), timeout=10))
            assert got_code == code and got_detail.startswith(detail), got_detail


# -- cancellation, deadlines, overload -----------------------------------------------------------------------------
def test_cancel_frees_the_slot(tiny_dir, reference):
    with running_server(tiny_dir, delay=0.02, max_batch_size=1) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        stream = client.generate_stream(PROMPTS[0], max_new_tokens=200, ignore_eos=True, request_id="long")
        assert next(stream).token_ids
        stream.close()  # cancels the call
        runner = server.engine._runner
        assert wait_until(lambda: runner.freed == [0]), "the cancelled sequence was freed"
        assert runner.inner.cache.num_free == 1
        started = time.monotonic()
        again = client.generate(PROMPTS[2], max_new_tokens=5, ignore_eos=True)
        assert time.monotonic() - started < 2.0, "the only slot was free at once"
        assert again.token_ids == reference.greedy(PROMPTS[2], 5, ignore_eos=True)
        metrics = scrape(server)
        assert metrics[("zspeed_requests_total", (("status", "cancelled"),))] == 1
        assert metrics[("zspeed_requests_running", ())] == 0


def test_deadline_ends_the_request(tiny_dir):
    with running_server(tiny_dir, delay=0.02, max_batch_size=1) as server, \
            Client(f"127.0.0.1:{server.port}") as client:
        code, _ = status_of(lambda: client.generate(PROMPTS[0], max_new_tokens=200, ignore_eos=True, timeout=0.3))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        runner = server.engine._runner
        assert wait_until(lambda: runner.freed == [0])
        assert client.generate(PROMPTS[2], max_new_tokens=3).completion_tokens == 3


def test_overload_is_refused_at_once_and_accepted_requests_complete(tiny_dir, reference):
    n = 8
    with running_server(tiny_dir, delay=0.03, max_batch_size=1, max_queue_size=2) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        outcomes: dict[int, tuple] = {}
        barrier = threading.Barrier(n)

        def one(i: int) -> None:
            barrier.wait()
            started = time.monotonic()
            try:
                outcomes[i] = ("ok", client.generate(PROMPTS[i % 4], max_new_tokens=6, ignore_eos=True),
                               time.monotonic() - started)
            except grpc.RpcError as e:
                outcomes[i] = (e.code(), e.details(), time.monotonic() - started)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        accepted = {i: o for i, o in outcomes.items() if o[0] == "ok"}
        refused = {i: o for i, o in outcomes.items() if o[0] != "ok"}
        assert len(outcomes) == n and 1 <= len(accepted) and len(refused) >= n - 4
        for i, (_, result, _) in accepted.items():
            assert result.token_ids == reference.greedy(PROMPTS[i % 4], 6, ignore_eos=True)
        slowest = max(seconds for _, _, seconds in accepted.values())
        for code, detail, seconds in refused.values():
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_size" in detail
            assert seconds < slowest / 2, "refused at once, not after waiting"
        metrics = scrape(server)
        assert metrics[("zspeed_requests_total", (("status", "queue_full"),))] == len(refused)
        assert metrics[("zspeed_requests_total", (("status", "length"),))] == len(accepted)


# -- security ------------------------------------------------------------------------------------------------------
def test_bearer_token_and_tls(tiny_dir):
    cert, key = DATA / "test_server_cert.pem", DATA / "test_server_key.pem"
    with running_server(tiny_dir, auth_token="s3cret", tls_cert=str(cert), tls_key=str(key)) as server:
        target = f"127.0.0.1:{server.port}"
        with Client(target, root_certificates=cert, timeout=30) as anonymous, \
                Client(target, root_certificates=cert, token="wrong", timeout=30) as wrong, \
                Client(target, root_certificates=cert, token="s3cret", timeout=30) as good:
            for client in (anonymous, wrong):
                for call in (lambda: client.generate([5, 6], max_new_tokens=2), client.model_info,
                             lambda: list(client.generate_stream([5], max_new_tokens=2))):
                    code, detail = status_of(call)
                    assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in detail
            assert anonymous.health() == "SERVING", "health checks need no token"
            assert good.generate([5, 6], max_new_tokens=2).completion_tokens == 2
            creds = grpc.ssl_channel_credentials(cert.read_bytes())
            with grpc.secure_channel(target, creds) as channel:  # reflection is a stream-stream call
                code, _ = status_of(lambda: ProtoReflectionDescriptorDatabase(channel).get_services())
                assert code == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(target) as plain:
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(plain).result(timeout=0.5)


# -- metrics and draining ------------------------------------------------------------------------------------------
def test_metrics_count_what_happened(tiny_dir):
    with running_server(tiny_dir, offload="cpu", max_prompt_tokens=100) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        client.generate(PROMPTS[0], max_new_tokens=5, ignore_eos=True)
        list(client.generate_stream(PROMPTS[1], max_new_tokens=7, ignore_eos=True))
        status_of(lambda: client.generate([1] * 101))
        m = scrape(server)
    assert m[("zspeed_requests_total", (("status", "length"),))] == 2
    assert m[("zspeed_requests_total", (("status", "invalid"),))] == 1
    assert m[("zspeed_generation_tokens_total", ())] == 12
    assert m[("zspeed_prompt_tokens_total", ())] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert m[("zspeed_time_to_first_token_seconds_count", ())] == 2
    assert m[("zspeed_e2e_request_latency_seconds_count", ())] == 2
    assert m[("zspeed_inter_token_latency_seconds_count", ())] == 4 + 6
    assert m[("zspeed_requests_running", ())] == 0 and m[("zspeed_requests_waiting", ())] == 0
    assert m[("zspeed_weight_stream_bytes_total", ())] > 0
    assert ("zspeed_device_memory_bytes", (("kind", "allocated"),)) in m


def test_sigterm_drains_then_exits_zero(tiny_dir, reference, tmp_path):
    """``zserve`` in a subprocess: SIGTERM during a long request stops admission, the request
    completes, the process exits 0."""
    long_dir = tmp_path / "tiny-4k"  # the same weights with room for a long generation
    shutil.copytree(tiny_dir, long_dir)
    config = json.loads((long_dir / "config.json").read_text())
    (long_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zspeed.serve.cli", "--model", str(long_dir), "--port", "0", "--device", "cpu",
         "--no-progress", "--max-new-tokens", "3000"],
        stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: any("listening on" in line for line in lines), timeout=60), "".join(lines)
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            stream = client.generate_stream(PROMPTS[1], max_new_tokens=3000, ignore_eos=True)
            pieces = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: client.health() == "NOT_SERVING", timeout=10)
            code, _ = status_of(lambda: client.generate([5], max_new_tokens=2))
            assert code == grpc.StatusCode.UNAVAILABLE, "no admission while draining"
            pieces += list(stream)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    tokens = tuple(t for p in pieces for t in p.token_ids)
    assert pieces[-1].finish_reason == "length" and len(tokens) == 3000
    assert tokens[:50] == reference.greedy(PROMPTS[1], 50, ignore_eos=True)
    assert any("drained" in line for line in lines), "".join(lines)
    frozen = next(i for i, line in enumerate(lines) if "start-up objects frozen" in line)
    assert frozen < next(i for i, line in enumerate(lines) if "listening on" in line), "gc.freeze before serving"
    # both processes exit clean: no extension objects left frozen past teardown (nanobind's "leaked instance" page)
    assert not any("leaked" in line for line in lines), "".join(lines[-20:])


def test_frozen_startup_objects_are_handed_back_at_exit():
    """[Note: GC freeze]: the start-up objects stay frozen while serving and are unfrozen as the interpreter exits,
    so its last collection frees them (frozen, torch's Triton bindings report a page of leaks at every exit)."""
    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))  # runs last (LIFO)\n"
            "import torch._dynamo\n"
            "from zspeed.serve.cli import freeze_startup_objects\n"
            "freeze_startup_objects()\n"
            "print('frozen while serving:', gc.get_freeze_count() > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "frozen while serving: True" in out.stdout and "frozen at exit: 0" in out.stdout, out.stdout
    assert "leaked" not in out.stderr, out.stderr[-2000:]


def test_build_request_marks_the_prompt():
    assert build_request([]).WhichOneof("prompt") == "token_ids"
    assert build_request("").WhichOneof("prompt") == "text"
