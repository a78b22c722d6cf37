"""Prometheus metrics: names, a dedicated registry, the HTTP page, and counts that match what happened."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zspeed.serve.errors import QueueFullError
from zspeed.serve.metrics import ServeMetrics, start_metrics_server
from zspeed.serve.request import Request, SamplingParams
from zspeed.serve.scheduler import RunnerOutput, Scheduler, SchedulerConfig

EXPECTED = {
    "zspeed_requests": "counter",
    "zspeed_request_queue_time_seconds": "histogram",
    "zspeed_time_to_first_token_seconds": "histogram",
    "zspeed_inter_token_latency_seconds": "histogram",
    "zspeed_e2e_request_latency_seconds": "histogram",
    "zspeed_batch_size": "histogram",
    "zspeed_prompt_tokens": "counter",
    "zspeed_generation_tokens": "counter",
    "zspeed_requests_running": "gauge",
    "zspeed_requests_waiting": "gauge",
    "zspeed_weight_stream_bytes": "counter",
    "zspeed_weight_stream_stall_seconds": "counter",
    "zspeed_device_memory_bytes": "gauge",
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Clock:
    t = 50.0

    def __call__(self) -> float:
        return self.t


class EchoRunner:
    """Always answers token 7; every step takes 10 ms of the fake clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def step(self, batch):
        self.clock.t += 0.01
        return RunnerOutput({seq_id: [7] for seq_id in batch.sampled_seq_ids})


def drive(sched: Scheduler, runner: EchoRunner) -> None:
    while sched.has_unfinished:
        batch = sched.schedule()
        if batch.has_work:
            sched.update(runner.step(batch))


def test_names_types_and_a_dedicated_registry():
    registry = CollectorRegistry()
    ServeMetrics(registry)
    ServeMetrics(CollectorRegistry())  # a second server in the process does not collide
    page = generate_latest(registry).decode()
    families = {f.name: f.type for f in text_string_to_metric_families(page)}
    assert {name: kind for name, kind in families.items() if not name.endswith("_created")} == EXPECTED
    assert all(line.startswith(("# ", "zspeed_")) for line in page.splitlines() if line)
    assert "zspeed_" not in generate_latest(REGISTRY).decode(), "the global registry is left alone"


def test_the_page_counts_what_happened():
    clock = Clock()
    registry = CollectorRegistry()
    metrics = ServeMetrics(registry)
    sched = Scheduler(SchedulerConfig(max_batch_size=2, max_queue_size=4), clock=clock, observer=metrics)
    runner = EchoRunner(clock)
    for i in range(4):
        sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=[1] * (i + 2),
                                  sampling=SamplingParams(max_new_tokens=3)))
    with pytest.raises(QueueFullError):
        sched.add_request(Request(request_id="extra", prompt_token_ids=[1]))
    sched.cancel("r3")
    drive(sched, runner)
    metrics.on_weights_streamed(1 << 20, stall_seconds=0.25)
    metrics.on_weights_streamed(1 << 20)
    metrics.set_device_memory(123456, kind="allocated")

    server = start_metrics_server(registry, port=0)
    try:
        assert server.host == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url, timeout=5) as response:
            page = response.read().decode()
    finally:
        server.close()
    got = samples(page)

    assert got[("zspeed_requests_total", (("status", "length"),))] == 3
    assert got[("zspeed_requests_total", (("status", "cancelled"),))] == 1
    assert got[("zspeed_requests_total", (("status", "queue_full"),))] == 1
    assert got[("zspeed_prompt_tokens_total", ())] == 2 + 3 + 4
    assert got[("zspeed_generation_tokens_total", ())] == 9
    assert got[("zspeed_time_to_first_token_seconds_count", ())] == 3
    assert got[("zspeed_inter_token_latency_seconds_count", ())] == 6
    assert got[("zspeed_inter_token_latency_seconds_sum", ())] == pytest.approx(0.06)
    assert got[("zspeed_request_queue_time_seconds_count", ())] == 3
    assert got[("zspeed_request_queue_time_seconds_sum", ())] == pytest.approx(0.03), "r2 waits 3 steps"
    assert got[("zspeed_e2e_request_latency_seconds_count", ())] == 4
    assert got[("zspeed_batch_size_count", ())] == 6 and got[("zspeed_batch_size_sum", ())] == 9
    assert got[("zspeed_requests_running", ())] == 0 and got[("zspeed_requests_waiting", ())] == 0
    assert got[("zspeed_weight_stream_bytes_total", ())] == 2 << 20
    assert got[("zspeed_weight_stream_stall_seconds_total", ())] == 0.25
    assert got[("zspeed_device_memory_bytes", (("kind", "allocated"),))] == 123456


def test_queue_gauges_follow_the_scheduler():
    registry = CollectorRegistry()
    sched = Scheduler(SchedulerConfig(max_batch_size=1), observer=ServeMetrics(registry))
    for i in range(3):
        sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=[1]))
    got = samples(generate_latest(registry).decode())
    assert got[("zspeed_requests_waiting", ())] == 3 and got[("zspeed_requests_running", ())] == 0
    sched.schedule()
    got = samples(generate_latest(registry).decode())
    assert got[("zspeed_requests_waiting", ())] == 2 and got[("zspeed_requests_running", ())] == 1
