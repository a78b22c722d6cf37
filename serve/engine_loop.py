"""The serving step loop: one thread that schedules, runs, updates and delivers.

Callers on other threads (gRPC handlers) :meth:`EngineLoop.submit` requests and
get a :class:`RequestHandle` back, which streams the request's events, waits
for its result, or cancels it. The loop owns the scheduler: every scheduler
call happens under the loop's lock, while ``runner.step`` runs outside it, so
requests arrive and cancel while the device works. Torch-free: the runner
is the only part that touches a device.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from .errors import EngineStoppedError
from .request import Request
from .scheduler import RunnerOutput, Scheduler, SchedulerOutput, SequenceEvent
from .sequence import SequenceStatus

log = logging.getLogger(__name__)

_MAX_IDLE_WAIT_S = 0.5  # re-check for work at least this often when idle
_MIN_IDLE_WAIT_S = 0.001  # and never spin


class Runner(Protocol):
    """The model side of a step. The engine loop calls it from its one thread."""

    def step(self, batch: SchedulerOutput) -> RunnerOutput:
        """Runs the batch's prefill chunks and decodes; returns the sampled tokens.

        Raising fails every sequence of the batch (they end ``FAILED``); the
        loop goes on with the next step.
        """
        ...

    def free(self, seq_id: int) -> None:
        """Forgets a finished sequence (its KV cache, its generator). Must accept
        ids of sequences whose only step failed."""
        ...


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished request, as its handle saw it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    status: SequenceStatus
    prompt_tokens: int
    error: str | None = None


class RequestHandle:
    """A caller's end of one request.

    Iterate it (once, from one thread) for its :class:`SequenceEvent` s in
    order, the last one ``finished``; or call :meth:`result` to wait for the
    whole output; :meth:`cancel` ends it early.
    """

    def __init__(self, request: Request, engine: EngineLoop) -> None:
        self.request = request
        self._engine = engine
        self._events: queue.SimpleQueue[SequenceEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._last: SequenceEvent | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Cancels the request (e.g. the client disconnected). False if it had already finished."""
        return self._engine.cancel(self.request_id)

    def __iter__(self) -> Iterator[SequenceEvent]:
        return self.stream()

    def stream(self, timeout: float | None = None) -> Iterator[SequenceEvent]:
        """Yields events in order until the finishing one (included).

        ``timeout`` bounds the wait for each event; past it, TimeoutError.
        """
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event for request {self.request_id!r} in {timeout} s") from None
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Waits for the request to finish, however it finishes."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} not finished in {timeout} s")
        assert self._last is not None
        return GenerationResult(
            request_id=self.request_id,
            token_ids=tuple(self._token_ids),
            text="".join(self._text),
            status=self._last.status,
            prompt_tokens=self.request.prompt_len,
            error=self._last.error,
        )

    def _deliver(self, event: SequenceEvent) -> None:
        """Called by the engine (under its lock), in event order."""
        self._token_ids.extend(event.token_ids)
        self._text.append(event.text)
        self._events.put(event)
        if event.finished:
            self._last = event
            self._done.set()


class EngineLoop:
    """Drives a :class:`Scheduler` and a :class:`Runner` from a thread of its own.

    Usage::

        with EngineLoop(Scheduler(SchedulerConfig()), runner) as engine:
            handle = engine.submit(Request(request_id="a", prompt_token_ids=[1, 2, 3]))
            for event in handle:
                ...

    :meth:`submit` raises what :meth:`Scheduler.add_request` raises
    (``QueueFullError``, ``DrainingError``, ...) at once, and
    ``EngineStoppedError`` after :meth:`stop`. :meth:`drain` (for SIGTERM)
    refuses new requests and waits for the accepted ones to finish.

    With ``sink``, events are not kept in handles: every batch of them goes to
    ``sink`` (from the loop's thread, under its lock, in order) and requests
    come in by :meth:`enqueue`; this is how the engine process forwards them
    (``engine_process.py``).
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, *, name: str = "zspeed-engine",
                 sink: Callable[[list[SequenceEvent]], None] | None = None, step_log: str | None = None) -> None:
        self._scheduler = scheduler
        self._runner = runner
        self._name = name
        self._sink = sink
        # One JSON line per step (``zserve --step-log``): what ran and how long each part took.
        self._step_log = open(step_log, "a", buffering=1) if step_log else None  # noqa: SIM115 - closed in stop
        self._cond = threading.Condition()
        self._handles: dict[str, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def drain(self, timeout: float | None = None) -> bool:
        """Stops admission and waits until every accepted request has finished.

        Returns False if ``timeout`` passed first (requests are still running).
        """
        with self._cond:
            self._scheduler.drain()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._scheduler.has_unfinished, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Ends the loop after the current step; whatever is unfinished ends ``FAILED``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._cond:
            self._scheduler.abort_all("the engine stopped")
            self._deliver()
            if self._step_log is not None:
                self._step_log.close()
                self._step_log = None

    def __enter__(self) -> EngineLoop:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- callers -----------------------------------------------------------------
    def now(self) -> float:
        """The scheduler's clock, on which :attr:`Request.deadline` is given."""
        return self._scheduler.now()

    @property
    def alive(self) -> bool:
        """The loop's thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._scheduler.accepting and not self._stopping

    def submit(self, request: Request) -> RequestHandle:
        if self._sink is not None:
            raise RuntimeError("this engine loop sends its events to a sink; use enqueue")
        handle = RequestHandle(request, self)
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("the engine loop is stopped")
            self._scheduler.add_request(request)
            self._handles[request.request_id] = handle
            self._cond.notify_all()
        return handle

    def enqueue(self, request: Request) -> None:
        """Like :meth:`submit` without a handle: the request's events go to the loop's ``sink``."""
        if self._sink is None:
            raise RuntimeError("enqueue needs an engine loop with a sink; use submit")
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("the engine loop is stopped")
            self._scheduler.add_request(request)
            self._cond.notify_all()

    def generate(self, request: Request, timeout: float | None = None) -> GenerationResult:
        """Submits a request and waits for its result."""
        return self.submit(request).result(timeout)

    def cancel(self, request_id: str) -> bool:
        """Cancels a request; its handle finishes at once, its slot frees at the next step."""
        with self._cond:
            cancelled = self._scheduler.cancel(request_id)
            self._deliver()
            self._cond.notify_all()
        return cancelled

    # -- the loop ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException:
            log.exception("the engine loop crashed; failing every request in flight")
            with self._cond:
                self._stopping = True
                self._scheduler.abort_all("the engine loop crashed")
                self._deliver()
            raise

    def _step(self) -> bool:
        """One iteration: schedule, free, run, update, deliver. False when stopping."""
        batch = self._schedule_or_wait()
        if batch is None:
            return False
        for seq_id in batch.freed_seq_ids:
            self._runner.free(seq_id)
        if not batch.has_work:
            return True
        started, cpu_started = time.monotonic(), time.thread_time()
        try:
            output = self._runner.step(batch)
        except Exception as exc:
            log.exception("runner.step failed at step %d; failing its %d sequences", batch.step, batch.batch_size)
            with self._cond:
                self._scheduler.abort_step(f"runner failed: {exc!r}")
                self._deliver()
            return True
        ran, cpu_ran = time.monotonic(), time.thread_time()
        with self._cond:
            self._scheduler.update(output)
            self._deliver()
        if self._step_log is not None:
            self._log_step(batch, started, ran, time.monotonic(), cpu_ran - cpu_started)
        return True

    def _log_step(self, batch: SchedulerOutput, started: float, ran: float, done: float, runner_cpu: float) -> None:
        """``runner_cpu_s``: CPU time of the engine thread inside the runner; far below ``runner_s``, the thread
        waited (for the GPU, the GIL, or a CPU the OS gave to something else)."""
        record = {"step": batch.step, "t": round(started, 6), "batch": batch.batch_size,
                  "prefills": len(batch.prefills), "prefill_tokens": batch.num_prefill_tokens,
                  "decodes": len(batch.decodes), "runner_s": round(ran - started, 6),
                  "runner_cpu_s": round(runner_cpu, 6), "update_s": round(done - ran, 6)}
        self._step_log.write(json.dumps(record) + "\n")

    def _schedule_or_wait(self) -> SchedulerOutput | None:
        with self._cond:
            while not self._stopping:
                batch = self._scheduler.schedule()
                self._deliver()
                if batch.has_work or batch.freed_seq_ids:
                    return batch
                self._cond.wait(self._idle_wait())
            return None

    def _idle_wait(self) -> float:
        wakeup = self._scheduler.next_wakeup()
        if wakeup is None:
            return _MAX_IDLE_WAIT_S
        return min(_MAX_IDLE_WAIT_S, max(_MIN_IDLE_WAIT_S, wakeup - self._scheduler.now()))

    def _deliver(self) -> None:
        """Hands the scheduler's events to their handles, or to the sink (caller holds the lock)."""
        finished = False
        events = self._scheduler.pop_events()
        if self._sink is not None:
            if events:
                self._sink(events)
                if any(event.finished for event in events):
                    self._cond.notify_all()
            return
        for event in events:
            if event.finished:
                handle = self._handles.pop(event.request_id)
                finished = True
            else:
                handle = self._handles[event.request_id]
            handle._deliver(event)
        if finished:
            self._cond.notify_all()
