"""The engine in a process of its own: model, runner, scheduler and step loop apart from the gRPC server.

[Note: engine process] The runner is host-bound Python: a decode step of
the resident Llama-8B shape takes ~1 ms of host time per layer and the GPU
waits for it. In one process every gRPC thread that streams a token needs the
GIL a few times per message (take the event, serialize, send, complete), so
with 32 streams the server's steps ran ~20% longer than the runner's alone
(H100, session 4: 53.5 ms vs 44 ms at batch 32), which cost throughput at
saturation and put GIL waits into the inter-token gaps. Here the child process
owns the device and runs :class:`~zspeed.serve.engine_loop.EngineLoop` with a
sink; the gRPC process keeps the network, tokenization of text prompts and
the metrics page. One pipe joins them:

    gRPC process -> engine    ("start" | "submit" | "cancel" | "drain" | "stop", call id, argument)
    engine -> gRPC process    ("out", observations, events, reply)

Each step's events travel as one message, with the metrics observations made
since the last one; a reply answers one call. Refusals (queue full,
draining, ...) come back as the same :class:`~zspeed.serve.errors.ServeError`
they were in the child, so the servicer maps them to the same gRPC status.
The child ignores SIGINT and SIGTERM (the gRPC process drains it), and stops
when its pipe closes, so a killed server leaves no engine behind. If the
child dies, every request in flight ends ``FAILED`` with its exit code, and
the server stops accepting.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from .engine_loop import EngineLoop, RequestHandle
from .errors import DuplicateRequestError, EngineStoppedError, ServeError
from .model_loader import LoadConfig, ModelDescription
from .request import Request
from .scheduler import SequenceEvent
from .sequence import SequenceStatus
from .tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("zspeed.serve")

# What the child's observer forwards: the methods of ServeMetrics that the scheduler and runner call.
OBSERVED = frozenset({"on_request_rejected", "on_queue_changed", "on_step", "on_request_finished",
                      "on_weights_streamed", "set_device_memory"})
_CONTROL_TIMEOUT_S = 60.0  # start / cancel / submit / stop answer within this or the child is hung


@dataclass(eq=False)
class _Call:
    """One call from the gRPC process, waiting for its reply."""

    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    value: object = None


class EngineProcess:
    """The engine loop's calls (submit, cancel, drain, stop, ...) on an engine in a child process.

    Construction spawns the child and returns once it has loaded the model
    (raising what loading raised); :attr:`description`, :attr:`tokenizer` and
    :attr:`max_model_len` describe it. :meth:`start` starts its step loop.
    """

    def __init__(self, load_config: LoadConfig, server_config, *, observer=None,
                 startup_timeout: float | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or gRPC threads
        self._conn, child_conn = ctx.Pipe()
        self._observer = observer
        self._lock = threading.Lock()  # guards the tables below
        self._send_lock = threading.Lock()
        self._join_lock = threading.Lock()  # one joiner at a time (see _join)
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._dead: str | None = None  # why the engine is gone, once it is
        self._process = ctx.Process(target=child_main, name="zserve-engine", daemon=True,
                                    args=(child_conn, load_config, server_config, logging.getLogger().level))
        self._process.start()
        child_conn.close()
        try:
            self.description, self.max_model_len = self._wait_ready(startup_timeout)
            self.tokenizer: Tokenizer = load_tokenizer(self.description.source)
        except BaseException as err:
            if not isinstance(err, Exception):  # interrupted (SIGTERM while loading): no reason to let it finish
                self._process.kill()
            self._reap()
            raise
        self._receiver = threading.Thread(target=self._receive, name="zserve-engine-pipe", daemon=True)
        self._receiver.start()

    def _wait_ready(self, timeout: float | None) -> tuple[ModelDescription, int]:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the engine process did not load the model in {timeout} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._join(5)
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode}) while loading the "
                               "model; its log is above") from None
        if msg[0] == "failed":
            raise msg[1]
        _, description, max_model_len = msg
        return description, max_model_len

    # -- the engine loop's calls -------------------------------------------------
    def start(self) -> EngineProcess:
        self._call("start", None)
        return self

    def now(self) -> float:
        """The scheduler's clock: ``time.monotonic``, which is the same in both processes."""
        return time.monotonic()

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def alive(self) -> bool:
        return self._dead is None

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request, self)
        with self._lock:
            if self._dead is not None:
                raise EngineStoppedError(self._dead)
            if request.request_id in self._handles:
                raise DuplicateRequestError(f"request id {request.request_id!r} is already in flight")
            self._handles[request.request_id] = handle  # before the call: its first events may beat the reply
        try:
            self._call("submit", request)
        except BaseException:
            with self._lock:
                if self._handles.get(request.request_id) is handle:
                    del self._handles[request.request_id]
            raise
        return handle

    def generate(self, request: Request, timeout: float | None = None):
        return self.submit(request).result(timeout)

    def cancel(self, request_id: str) -> bool:
        try:
            return bool(self._call("cancel", request_id))
        except EngineStoppedError:
            return False

    def drain(self, timeout: float | None = None) -> bool:
        """Stops admission and waits until every accepted request has finished (False: timed out)."""
        self._accepting = False
        try:
            return bool(self._call("drain", timeout, timeout=None if timeout is None else timeout + 30))
        except EngineStoppedError:
            return not self._handles

    def stop(self, timeout: float | None = None) -> None:
        """Ends the engine (what is unfinished ends ``FAILED``) and its process."""
        self._accepting = False
        if self._dead is None:
            try:
                self._call("stop", None, timeout=_CONTROL_TIMEOUT_S if timeout is None else timeout)
            except (EngineStoppedError, TimeoutError) as err:
                log.warning("engine process did not stop cleanly: %s", err)
        self._reap()

    def _reap(self) -> None:
        if self._join(30):
            log.warning("engine process still running after stop; killing it")
            self._process.kill()
            self._join(10)
        self._conn.close()

    def _join(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for the child to exit; whether it still runs. The pipe's receiver and
        :meth:`stop` both wait for it. Two threads in ``Process.join`` at once race: the one whose ``waitpid``
        loses gets ECHILD, which multiprocessing reads as "still running" until the other records the exit code,
        and a clean stop was then reported as a hang and the exited child killed."""
        with self._join_lock:
            self._process.join(timeout)
            return self._process.is_alive()

    # -- the pipe ----------------------------------------------------------------
    def _call(self, op: str, arg: object, *, timeout: float | None = _CONTROL_TIMEOUT_S) -> object:
        call = _Call()
        with self._lock:
            if self._dead is not None:
                raise EngineStoppedError(self._dead)
            call_id = next(self._ids)
            self._calls[call_id] = call
        try:
            with self._send_lock:
                self._conn.send((op, call_id, arg))
        except (OSError, ValueError):  # the pipe is closed: the receiver fails the call
            pass
        if not call.done.wait(timeout):
            with self._lock:
                self._calls.pop(call_id, None)
            raise TimeoutError(f"the engine process did not answer {op!r} in {timeout} s")
        if not call.ok:
            raise call.value  # type: ignore[misc]
        return call.value

    def _receive(self) -> None:
        try:
            while True:
                _, observed, events, reply = self._conn.recv()
                self._observe(observed)
                self._deliver(events)
                if reply is not None:
                    call_id, ok, value = reply
                    with self._lock:
                        call = self._calls.pop(call_id, None)
                    if call is not None:
                        call.ok, call.value = ok, value
                        call.done.set()
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("engine pipe: unreadable message; treating the engine as gone")
        self._join(5)
        self._gone(f"the engine process exited (code {self._process.exitcode})")

    def _observe(self, observed: list) -> None:
        if self._observer is None:
            return
        for name, args, kwargs in observed:
            if name in OBSERVED:
                getattr(self._observer, name)(*args, **kwargs)

    def _deliver(self, events: list[SequenceEvent]) -> None:
        for event in events:
            with self._lock:
                handle = (self._handles.pop if event.finished else self._handles.get)(event.request_id, None)
            if handle is not None:
                handle._deliver(event)

    def _gone(self, why: str) -> None:
        """The child is gone: fail what waits on it."""
        with self._lock:
            self._dead = self._dead or why
            calls, self._calls = self._calls, {}
            handles, self._handles = self._handles, {}
        for call in calls.values():
            call.ok, call.value = False, EngineStoppedError(why)
            call.done.set()
        for request_id, handle in handles.items():
            log.error("request %s failed: %s", request_id, why)
            handle._deliver(SequenceEvent(request_id=request_id, seq_id=-1, token_ids=(), text="",
                                          status=SequenceStatus.FAILED, error=why))


# -- the child ----------------------------------------------------------------------------------------------------
class _Outbox:
    """The child's end of the pipe: events, replies and observations, sent from any thread in order."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._observed: list[tuple[str, tuple, dict]] = []

    def observe(self, name: str, args: tuple, kwargs: dict) -> None:
        with self._lock:
            self._observed.append((name, args, kwargs))

    def events(self, events: list[SequenceEvent]) -> None:
        self._send(events, None)

    def reply(self, call_id: int, ok: bool, value: object) -> None:
        if not ok and not isinstance(value, ServeError):
            value = RuntimeError(f"engine process: {type(value).__name__}: {value}")
        self._send([], (call_id, ok, value))

    def _send(self, events: list[SequenceEvent], reply: tuple | None) -> None:
        with self._lock:
            observed, self._observed = self._observed, []
            try:
                self._conn.send(("out", observed, events, reply))
            except OSError:  # the gRPC process is gone; the command loop sees the pipe close and stops
                pass


class ForwardingObserver:
    """The child's metrics observer: each method named in :data:`OBSERVED` sends its call to the gRPC process's
    :class:`ServeMetrics` (made from that set below, so the two cannot drift apart)."""

    def __init__(self, outbox: _Outbox) -> None:
        self._outbox = outbox


def _forwarder(name: str):
    def forward(self: ForwardingObserver, *args, **kwargs) -> None:
        self._outbox.observe(name, args, kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


for _name in sorted(OBSERVED):
    setattr(ForwardingObserver, _name, _forwarder(_name))


def child_main(conn, load_config: LoadConfig, server_config, log_level: int) -> None:
    """The engine process: load, report ready, then serve the gRPC process's calls until "stop" or EOF."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the gRPC process drains us; a signal to the group must not
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level or logging.INFO, stream=sys.stderr,
                        format="%(asctime)s zserve-engine %(levelname)s %(message)s")
    from zspeed.core.store_config import StoreError

    from .cli import freeze_startup_objects
    from .model_loader import load_model
    from .server import build_engine

    outbox = _Outbox(conn)
    try:
        model = load_model(load_config)
        engine, runner, max_model_len = build_engine(model, server_config, observer=ForwardingObserver(outbox),
                                                     sink=outbox.events)
    except BaseException as err:  # noqa: BLE001 - every start-up failure goes to the parent, then we exit
        if isinstance(err, StoreError):
            err = OSError(f"weight store: {err}")
        elif not isinstance(err, (ValueError, OSError, ServeError)):
            err = RuntimeError(f"engine process: {type(err).__name__}: {err}")
        conn.send(("failed", err))
        return
    conn.send(("ready", model.description, max_model_len))
    freeze_startup_objects()
    try:
        _serve_calls(conn, engine, outbox)
    finally:
        engine.stop()
        runner.close()


def _serve_calls(conn, engine: EngineLoop, outbox: _Outbox) -> None:
    while True:
        try:
            op, call_id, arg = conn.recv()
        except (EOFError, OSError):
            log.warning("the gRPC process is gone; stopping the engine")
            return
        if op == "drain":  # waits for requests to finish: answer from a thread, keep taking cancels
            threading.Thread(target=_answer, args=(outbox, call_id, engine.drain, arg), daemon=True).start()
            continue
        if op == "stop":
            _answer(outbox, call_id, engine.stop)
            return
        call = {"start": lambda _: _start(engine), "submit": engine.enqueue, "cancel": engine.cancel}[op]
        _answer(outbox, call_id, call, arg)


def _start(engine: EngineLoop) -> None:
    engine.start()


def _answer(outbox: _Outbox, call_id: int, fn, *args) -> None:
    try:
        value = fn(*args)
    except Exception as err:  # noqa: BLE001 - goes back to the caller
        outbox.reply(call_id, False, err)
    else:
        outbox.reply(call_id, True, value)
