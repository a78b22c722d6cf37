"""Prometheus metrics of the server, on a registry of their own.

:class:`ServeMetrics` is the scheduler's :class:`~zspeed.serve.stats.StatsObserver`
(requests, latencies, batches, tokens, queue sizes) and takes the runner's
figures (weight-streaming bytes and stalls, device memory) through plain
methods. Its metrics live on the :class:`CollectorRegistry` it is given, never
on prometheus-client's global one, so several servers (or tests) in one process
do not collide. :func:`start_metrics_server` serves the registry over HTTP on a
port of its own, bound to 127.0.0.1 unless told otherwise.

Names follow the Prometheus conventions: the ``zspeed_`` prefix, base units in
the name (``_seconds``, ``_bytes``), ``_total`` on counters.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from .stats import RequestStats, StepStats

# Seconds. Token latencies run from sub-millisecond (small models on a GPU) to
# seconds (a 70B model streamed from disk); request latencies to minutes.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServeMetrics:
    """The server's metrics, registered on ``registry``.

    Every method is thread-safe (prometheus-client's metrics are).
    """

    def __init__(self, registry: CollectorRegistry, *, namespace: str = "zspeed") -> None:
        self.registry = registry
        kw = {"namespace": namespace, "registry": registry}
        self.requests = Counter(
            "requests",
            "Requests by how they ended (stopped, length, cancelled, deadline_exceeded, failed) "
            "or why they were refused (queue_full, draining, invalid, duplicate).",
            ["status"],
            **kw,
        )
        self.queue_time = Histogram(
            "request_queue_time_seconds", "Time from arrival to admission into the batch.",
            buckets=REQUEST_LATENCY_BUCKETS, **kw,
        )
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=REQUEST_LATENCY_BUCKETS, **kw,
        )
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            buckets=TOKEN_LATENCY_BUCKETS, **kw,
        )
        self.e2e_latency = Histogram(
            "e2e_request_latency_seconds", "Time from arrival to the end of a request, however it ended.",
            buckets=REQUEST_LATENCY_BUCKETS, **kw,
        )
        self.batch_size = Histogram(
            "batch_size", "Sequences run per step (prefilling and decoding).", buckets=BATCH_SIZE_BUCKETS, **kw
        )
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens prefilled.", **kw)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated.", **kw)
        self.running = Gauge("requests_running", "Requests in the batch.", **kw)
        self.waiting = Gauge("requests_waiting", "Requests queued for admission.", **kw)
        self.weight_stream_bytes = Counter(
            "weight_stream_bytes", "Weight bytes streamed to the device (ZeRO-Inference offload).", **kw
        )
        self.weight_stream_stall = Counter(
            "weight_stream_stall_seconds", "Time compute waited for streamed weights to arrive.", **kw
        )
        self.device_memory = Gauge(
            "device_memory_bytes", "Device memory by kind (allocated, reserved, total).", ["kind"], **kw
        )

    # -- StatsObserver -----------------------------------------------------------
    def on_request_rejected(self, reason: str) -> None:
        self.requests.labels(status=reason).inc()

    def on_queue_changed(self, num_running: int, num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def on_step(self, stats: StepStats) -> None:
        self.batch_size.observe(stats.batch_size)
        self.prompt_tokens.inc(stats.num_prefill_tokens)
        self.generation_tokens.inc(stats.num_generated_tokens)
        for seconds in stats.queue_times:
            self.queue_time.observe(seconds)
        for seconds in stats.times_to_first_token:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.inter_token_latencies:
            self.inter_token_latency.observe(seconds)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.requests.labels(status=stats.status).inc()
        self.e2e_latency.observe(stats.e2e_latency)

    # -- the runner's figures ----------------------------------------------------
    def on_weights_streamed(self, num_bytes: int, stall_seconds: float = 0.0) -> None:
        """Counts weight bytes moved to the device and the time compute waited for them."""
        self.weight_stream_bytes.inc(num_bytes)
        self.weight_stream_stall.inc(stall_seconds)

    def set_device_memory(self, num_bytes: int, *, kind: str = "allocated") -> None:
        self.device_memory.labels(kind=kind).set(num_bytes)

    def render(self) -> str:
        """The registry in the Prometheus text format (what the HTTP page serves)."""
        return generate_latest(self.registry).decode("utf-8")


@dataclass
class MetricsServer:
    """A running exposition server; :meth:`close` stops it."""

    host: str
    port: int
    _server: object
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]
        self._thread.join()


def start_metrics_server(registry: CollectorRegistry, *, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serves ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    Binds loopback by default; pass ``host="0.0.0.0"`` to let a Prometheus
    elsewhere scrape it. ``port=0`` picks a free port (see the returned
    server's ``port``).
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host=host, port=server.server_port, _server=server, _thread=thread)
