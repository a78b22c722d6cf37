"""The gRPC server: the generation service, health, reflection, auth, TLS, metrics, and draining.

:func:`create_server` wires a loaded model into a runner, a scheduler, an
engine loop and a :class:`Server`; :meth:`Server.start` binds the ports and
:meth:`Server.drain` is what SIGTERM does: stop admission (health goes
``NOT_SERVING``, new requests get ``UNAVAILABLE``), let every accepted request
finish, let the RPCs deliver their last messages, then stop.

Safe by default: binds 127.0.0.1 (``host`` to change), caps prompt length,
``max_new_tokens`` and message sizes, and with ``auth_token`` set refuses
every call without ``authorization: Bearer <token>`` metadata as
``UNAUTHENTICATED`` (the health service stays open for load balancers' probes;
it reveals nothing but SERVING / NOT_SERVING).
"""
from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

import zspeed

from ._proto import serve_pb2, serve_pb2_grpc
from .engine_loop import EngineLoop, Runner
from .metrics import MetricsServer, ServeMetrics, start_metrics_server
from .model_loader import LoadConfig, LoadedModel, ModelDescription
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig, SequenceEvent
from .servicer import GenerationServicer, RequestLimits
from .stats import StatsObserver
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .engine_process import EngineProcess

log = logging.getLogger("zspeed.serve")

SERVICE_NAME = serve_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
_DEFAULT_MAX_MODEL_LEN = 4096
FLOOD_RPCS = 512  # calls waiting for an RPC thread beyond the pool before gRPC itself refuses ([Note: refusals are
# counted])


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """Network, security, batching and request limits of a server.

    ``port=0`` / ``metrics_port=0`` pick free ports; ``metrics_port=None``
    serves no metrics page. ``max_model_len=None`` takes the model's positions
    (at most 4096); ``max_prompt_tokens=None`` allows ``max_model_len - 1``.
    ``max_workers`` is the number of RPC threads (default: one for every running
    and queued request plus 8 for refusals, health and info; see [Note: refusals
    are counted]); gRPC itself refuses calls beyond ``max_workers +
    FLOOD_RPCS``. ``step_log`` appends one JSON line per engine step to that
    file (what ran, how long the runner took).
    ``cuda_graphs`` is the runner's ``graphs`` ([Note: piecewise graphs]; None:
    where supported), ``attention_kernel`` its ``attention_kernel``.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    max_batch_size: int = 8
    max_num_batched_tokens: int = 2048
    max_queue_size: int = 64
    max_queue_delay_ms: float = 0.0
    max_prefill_tokens_per_step: int | None = 96  # None: no cap ([Note: prefill cap default] in scheduler.py)
    prefill_pacing_steps: int | None = 2  # None: the whole cap ([Note: prefill pacing] in scheduler.py)
    max_model_len: int | None = None
    max_prompt_tokens: int | None = None
    max_new_tokens: int = 2048
    default_max_new_tokens: int = 64
    max_message_bytes: int = 4 << 20
    max_workers: int | None = None
    drain_timeout_s: float = 300.0
    step_log: str | None = None
    cuda_graphs: bool | None = None
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM files)")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be empty")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes={self.max_message_bytes}: use at least 1024")
        if self.max_workers is not None and self.max_workers <= self.max_batch_size + self.max_queue_size:
            raise ValueError(f"max_workers={self.max_workers}: use more than max_batch_size + max_queue_size "
                             f"({self.max_batch_size + self.max_queue_size}), so refusals and health checks get "
                             "a thread")
        if not 0 <= self.port < 65536 or (self.metrics_port is not None and not 0 <= self.metrics_port < 65536):
            raise ValueError(f"ports must be in [0, 65535]: port={self.port}, metrics_port={self.metrics_port}")


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (constant-time compare) as UNAUTHENTICATED."""

    def __init__(self, token: str, *, open_prefixes: tuple[str, ...] = (_HEALTH_PREFIX,)) -> None:
        self._expected = f"Bearer {token}".encode()
        self._open = open_prefixes

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""

    def deny(request_or_iterator, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'")

    serde = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **serde)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **serde)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **serde)
    return grpc.stream_stream_rpc_method_handler(deny, **serde)


class Server:
    """A running (after :meth:`start`) gRPC server over one engine loop.

    Build it with :func:`create_server`. ``port`` and ``metrics_url`` are
    known after :meth:`start`.
    """

    def __init__(self, config: ServerConfig, *, engine: EngineLoop | EngineProcess, servicer: GenerationServicer,
                 metrics: ServeMetrics, on_close: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.port: int | None = None
        self._metrics_server: MetricsServer | None = None
        self._on_close = on_close
        self._health = health.HealthServicer()
        self._grpc = self._build_grpc(servicer)
        self._stopped = threading.Event()

    def _build_grpc(self, servicer: GenerationServicer) -> grpc.Server:
        cfg = self.config
        workers = cfg.max_workers or cfg.max_batch_size + cfg.max_queue_size + 8
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = [BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else []
        # [Note: refusals are counted] gRPC's own refusals (maximum_concurrent_rpcs) reach no metric, and in a
        # burst the calls the servicer is about to refuse fill that count too: with the limit at the thread count,
        # gRPC refused 27 of a 150-request burst's 78 refusals first, uncounted. The scheduler bounds what holds a
        # thread for long (running + queued requests); the spare threads refuse the rest at once, counted, while
        # calls beyond the pool wait the moment it takes. gRPC's limit stays, far above that, against floods.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zserve-rpc"),
                             interceptors=interceptors, options=options,
                             maximum_concurrent_rpcs=workers + FLOOD_RPCS)
        serve_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    @property
    def address(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self._metrics_server is None else self._metrics_server.url

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> Server:
        cfg = self.config
        bind = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(),
                                                      Path(cfg.tls_cert).read_bytes())])
                self.port = self._grpc.add_secure_port(bind, creds)
            else:
                self.port = self._grpc.add_insecure_port(bind)
        except RuntimeError:  # grpc's "Failed to bind": taken since any check, or not an address of this host
            self.port = 0
        if not self.port:
            raise OSError(f"{bind} is in use or not an address of this host (port); choose another port or host")
        if cfg.metrics_port is not None:
            try:
                self._metrics_server = start_metrics_server(self.metrics.registry, port=cfg.metrics_port,
                                                            host=cfg.metrics_host)
            except OSError as e:
                raise OSError(f"{cfg.metrics_host}:{cfg.metrics_port} (metrics_port): {e.strerror}; "
                              "choose another port") from None
        self.engine.start()
        self._grpc.start()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("listening on %s (%s%s)%s", self.address, "TLS" if cfg.tls_cert else "plaintext",
                 ", bearer token required" if cfg.auth_token else "",
                 f"; metrics at {self.metrics_url}" if self._metrics_server else "")
        return self

    def drain(self, timeout: float | None = None) -> bool:
        """Stops admission, waits for accepted requests to finish and their RPCs to end, then stops.

        Returns False if requests were still running after ``timeout`` (they end ``FAILED``).
        """
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        log.info("draining: no new requests; waiting up to %.0fs for those in flight", timeout)
        self._health.enter_graceful_shutdown()
        finished = self.engine.drain(timeout)
        self.stop(grace=5.0)
        log.info("drained%s; stopped", "" if finished else " (timed out: unfinished requests failed)")
        return finished

    def stop(self, grace: float | None = None) -> None:
        """Stops the RPCs (after ``grace`` seconds for those in flight), the engine and the metrics page."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._health.enter_graceful_shutdown()
        done = self._grpc.stop(grace)
        self.engine.stop()
        done.wait()
        if self._metrics_server is not None:
            self._metrics_server.close()
        self._on_close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=0)


def create_server(model: LoadedModel, config: ServerConfig, *,
                  wrap_runner: Callable[[ModelRunner], Runner] | None = None,
                  registry: CollectorRegistry | None = None) -> Server:
    """A :class:`Server` for ``model`` with the engine loop in this process (not started).

    ``wrap_runner`` lets tests slow or watch the runner. ``zserve`` runs the
    engine in a process of its own instead (:func:`create_process_server`).
    """
    metrics = ServeMetrics(registry or CollectorRegistry())
    engine, runner, max_model_len = build_engine(model, config, observer=metrics, wrap_runner=wrap_runner)
    servicer, limits = _servicer(engine, model.description, model.tokenizer, max_model_len, config, metrics)
    return Server(config, engine=engine, servicer=servicer, metrics=metrics, on_close=runner.close)


def create_process_server(load_config: LoadConfig, config: ServerConfig, *,
                          registry: CollectorRegistry | None = None) -> Server:
    """A :class:`Server` whose model, runner and scheduler live in a child process (not started).

    Loads the model there (this returns once it is loaded); see [Note: engine process] in
    ``engine_process.py`` for why serving is split in two processes.
    """
    from .engine_process import EngineProcess

    metrics = ServeMetrics(registry or CollectorRegistry())
    engine = EngineProcess(load_config, config, observer=metrics)
    try:
        servicer, _ = _servicer(engine, engine.description, engine.tokenizer, engine.max_model_len, config, metrics)
    except BaseException:
        engine.stop()
        raise
    return Server(config, engine=engine, servicer=servicer, metrics=metrics)


def build_engine(model: LoadedModel, config: ServerConfig, *, observer: ServeMetrics | StatsObserver,
                 wrap_runner: Callable[[ModelRunner], Runner] | None = None,
                 sink: Callable[[list[SequenceEvent]], None] | None = None,
                 ) -> tuple[EngineLoop, ModelRunner, int]:
    """The runner, scheduler and engine loop of ``model`` under ``config``; also the max model length."""
    desc = model.description
    max_model_len = config.max_model_len or min(desc.max_position_embeddings, desc.sliding_window or 1 << 62,
                                                 _DEFAULT_MAX_MODEL_LEN)
    runner = ModelRunner(model, max_batch_size=config.max_batch_size, max_model_len=max_model_len, observer=observer,
                         graphs=config.cuda_graphs, attention_kernel=config.attention_kernel)
    scheduler = Scheduler(
        SchedulerConfig(max_batch_size=config.max_batch_size, max_num_batched_tokens=config.max_num_batched_tokens,
                        max_queue_size=config.max_queue_size, max_queue_delay_ms=config.max_queue_delay_ms,
                        max_prefill_tokens_per_step=config.max_prefill_tokens_per_step,
                        prefill_pacing_steps=config.prefill_pacing_steps, max_model_len=max_model_len,
                        eos_token_ids=frozenset(desc.eos_token_ids)),
        kv_capacity=runner.kv_capacity, detokenize=model.tokenizer.decode, observer=observer,
    )
    engine = EngineLoop(scheduler, wrap_runner(runner) if wrap_runner else runner, sink=sink,
                        step_log=config.step_log)
    return engine, runner, max_model_len


def _servicer(engine, desc: ModelDescription, tokenizer: Tokenizer, max_model_len: int, config: ServerConfig,
              metrics: ServeMetrics) -> tuple[GenerationServicer, RequestLimits]:
    limits = RequestLimits(vocab_size=desc.vocab_size, max_prompt_tokens=config.max_prompt_tokens or max_model_len - 1,
                           max_new_tokens=config.max_new_tokens,
                           default_max_new_tokens=min(config.default_max_new_tokens, config.max_new_tokens))
    servicer = GenerationServicer(engine, tokenizer=tokenizer, limits=limits,
                                  model_info=_model_info(desc, limits, max_model_len, config), observer=metrics)
    return servicer, limits


def _model_info(desc: ModelDescription, limits: RequestLimits, max_model_len: int,
                config: ServerConfig) -> serve_pb2.ModelInfoResponse:
    return serve_pb2.ModelInfoResponse(
        model_id=desc.model_id, architecture=desc.architecture, vocab_size=desc.vocab_size,
        max_model_len=max_model_len, eos_token_ids=desc.eos_token_ids, max_prompt_tokens=limits.max_prompt_tokens,
        max_new_tokens=limits.max_new_tokens, max_batch_size=config.max_batch_size,
        dtype=str(desc.dtype).removeprefix("torch."), quantization=desc.quantization, offload=desc.offload.value,
        num_layers=desc.num_layers, num_parameters=desc.num_parameters, server_version=zspeed.__version__,
    )
