"""``zserve`` as an operator meets it: start-up order, taken ports, flag errors, help, and overload accounting."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.serve_cases import PROMPTS, load_tiny, scrape, status_of
from tests.test_serve_grpc import running_server
from zspeed.serve import Client
from zspeed.serve.cli import main as zserve_main
from zspeed.serve.server import ServerConfig, create_server

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def taken_port():
    """A port something is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- zserve query --wait -------------------------------------------------------------------------------------------
def test_query_waits_for_a_server_that_is_still_starting(tiny_dir, capsys):
    port = free_port()
    rc: list[int] = []
    query = threading.Thread(target=lambda: rc.append(zserve_main(
        ["query", "--port", str(port), "--wait", "60", "--token-ids", "5 6 7", "--max-new-tokens", "3"])))
    query.start()  # before the server exists, as in the README's `zserve ... &` then `zserve query`
    time.sleep(1.5)
    with running_server(tiny_dir, port=port):
        query.join(60)
    assert rc == [0]
    err = capsys.readouterr().err
    assert f"waiting up to 60s for the server at 127.0.0.1:{port}" in err
    assert "[length: 3 prompt + 3 generated tokens]" in err


def test_query_without_a_server_fails_naming_the_address(capsys):
    port = free_port()
    started = time.monotonic()
    assert zserve_main(["query", "--port", str(port), "--wait", "1", "hello"]) == 1
    assert time.monotonic() - started < 10
    assert f"zserve query: error: no server ready at 127.0.0.1:{port} after 1s" in capsys.readouterr().err


# -- ports ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_taken_port_is_refused_before_loading(taken_port, flag, capsys):
    other = ["--metrics-port", "0"] if flag == "--port" else ["--port", "0"]
    started = time.monotonic()
    assert zserve_main(["--model", "no-such-model-folder", flag, str(taken_port), *other]) == 2
    err = capsys.readouterr().err
    assert f"zserve: error: 127.0.0.1:{taken_port} is in use ({flag}); choose another port" in err
    assert "Traceback" not in err and time.monotonic() - started < 30


def test_a_port_taken_after_the_check_is_a_clear_error(tiny_dir, taken_port):
    for fields, name in (({"port": taken_port}, "(port)"), ({"port": 0, "metrics_port": taken_port},
                                                            "(metrics_port)")):
        server = create_server(load_tiny(tiny_dir), ServerConfig(max_batch_size=2, **fields))
        try:
            with pytest.raises(OSError, match=rf"127\.0\.0\.1:{taken_port}.*{re.escape(name)}.*choose another port"):
                server.start()
        finally:
            server.stop(grace=0)


# -- flags and help ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--metrics-port", "-1"], "--metrics-port must be in [0, 65535], got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--max-queue-size", "0"], "--max-queue-size must be >= 1, got 0"),
    (["--max-batch-size", "16", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be >= 16, got 8"),
    (["--window", "0"], "--window must be >= 1, got 0"),
])
def test_bad_numbers_name_their_flag(argv, message, capsys):
    assert zserve_main(["--model", "tiny", "--random-weights", *argv]) == 2
    assert f"zserve: error: {message}" in capsys.readouterr().err


def test_query_numbers_name_their_flag(capsys):
    assert zserve_main(["query", "--wait", "-1", "hi"]) == 2
    assert "zserve query: error: --wait must be >= 0, got -1" in capsys.readouterr().err


def test_help_mentions_the_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        zserve_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "zserve query" in out and "zserve synth" in out


# -- signals -------------------------------------------------------------------------------------------------------
def test_sigterm_while_loading_exits_zero(tiny_dir):
    proc = subprocess.Popen([sys.executable, "-m", "zspeed.serve.cli", "--model", str(tiny_dir), "--port", "0",
                             "--device", "cpu", "--no-progress"], stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        time.sleep(2.0)  # importing torch and loading take longer than this
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by a signal while loading the model" in err and "Traceback" not in err


# -- overload accounting -------------------------------------------------------------------------------------------
def test_every_refusal_of_a_burst_is_counted(tiny_dir):
    """A burst far beyond the RPC threads: each refusal is the servicer's (RESOURCE_EXHAUSTED naming the queue)
    and counted as queue_full; every accepted request completes."""
    n = 60
    with running_server(tiny_dir, delay=0.03, max_batch_size=1, max_queue_size=2) as server, \
            Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        outcomes: list[tuple] = []
        barrier = threading.Barrier(n)

        def one(i: int) -> None:
            barrier.wait()
            try:
                outcomes.append(("ok", client.generate(PROMPTS[i % 4], max_new_tokens=4, ignore_eos=True)))
            except grpc.RpcError as e:
                outcomes.append((e.code(), e.details()))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(outcomes) == n, "no request hung or was dropped"
        refused = [o for o in outcomes if o[0] != "ok"]
        assert refused and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_size" in detail
                               for code, detail in refused), {o[1] for o in refused}
        metrics = scrape(server)
        assert metrics[("zspeed_requests_total", (("status", "queue_full"),))] == len(refused)
        assert metrics[("zspeed_requests_total", (("status", "length"),))] == n - len(refused)


def test_an_expired_client_deadline_is_counted_as_deadline_exceeded(tiny_dir):
    with running_server(tiny_dir, delay=0.02, max_batch_size=1) as server, \
            Client(f"127.0.0.1:{server.port}") as client:
        code, _ = status_of(lambda: client.generate(PROMPTS[0], max_new_tokens=200, ignore_eos=True, timeout=0.3))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.2)
        metrics = scrape(server)
    assert metrics[("zspeed_requests_total", (("status", "deadline_exceeded"),))] == 1
    assert ("zspeed_requests_total", (("status", "cancelled"),)) not in metrics
