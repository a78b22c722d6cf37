"""Continuous (iteration-level) batching in pure Python: no torch here.

The engine loop drives a :class:`Scheduler` one step at a time::

    batch = scheduler.schedule()          # which sequences run, and on which tokens
    output = runner.step(batch)           # the only part that touches a device
    scheduler.update(output)              # append tokens, check stops, retire
    deliver(scheduler.pop_events())       # stream tokens and endings to clients

Requests join the batch at the next step after they arrive and leave it the
step they finish, so the batch is refilled every iteration rather than per
request. The scheduler is not thread-safe: one owner (the engine loop)
serializes every call.

[Note: admission] Each step first gives every decoding sequence one token of
the step's token budget, then continues sequences still prefilling, then admits
waiting requests in arrival order (FCFS) while the batch has a free slot, the
budget has tokens left and the KV cache can hold the newcomer's worst case.
Admission stops at the first request that does not fit: nobody overtakes the
head of the queue, so nobody starves. With chunked prefill a prompt is fed in
pieces that fit the budget; without it a prompt is fed whole or waits.

[Note: KV reservation] Admitting a sequence reserves the most KV entries it can
ever need (prompt + max output - 1) against ``kv_capacity()``; the reservation
is returned when it leaves. A running sequence therefore never runs out of
cache and is never preempted, at the price of admitting fewer sequences than
an optimistic scheme when most requests stop early.

[Note: queue delay] With ``max_queue_delay_ms > 0`` waiting requests are held
back until the batch would be full (they fill every free slot, or the step's
token budget) or the oldest of them has waited that long, so that a burst of
arrivals is prefilled together instead of one by one. While draining, nothing
new can arrive, so nothing is held back.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence as Seq

from .errors import (
    DrainingError,
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLongError,
    ServeError,
)
from .request import Request, SamplingParams
from .sequence import Detokenize, Sequence, SequenceStatus
from .stats import NullObserver, RequestStats, StatsObserver, StepStats

# The smallest prompt chunk a paced step feeds ([Note: prefill pacing]): the Llama-8B matmuls stay
# memory-bound up to ~100 rows (session 5 step logs), so at batch 32 a smaller chunk would save little
# step time and only add steps to the first token.
PACING_MIN_CHUNK = 32

Clock = Callable[[], float]
KVCapacity = Callable[[], int | None]
"""Returns how many tokens (KV entries, all sequences together) the runner's
cache holds, or None for no limit. Asked at every admission."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Limits of the batcher.

    ``max_num_batched_tokens`` is the step's token budget: prompt tokens fed
    plus one per decoding sequence. ``max_prefill_tokens_per_step`` caps the
    prompt tokens of a step in which sequences decode (None: no cap beyond the
    budget): a step that also prefills takes longer, and every decoding
    sequence waits for it, so a small cap keeps inter-token gaps even, at the
    cost of a few steps' more time to first token. The cap is lifted while
    there is a backlog: more requests waiting than the batch has free slots,
    or than an eighth of the batch size (a burst: admitting it fast is worth
    more than even gaps, and throughput at saturation stays that of
    whole-prompt prefill; requests arriving one by one below saturation rarely
    queue that deep). A step with nothing decoding prefills up to the whole
    budget ([Note: prefill cap default]). ``prefill_pacing_steps`` spreads the
    prompt tokens still to feed over about that many steps under the cap
    ([Note: prefill pacing]). ``max_queue_size`` bounds the waiting
    queue (running sequences do not count). ``max_model_len`` bounds prompt +
    output. ``eos_token_ids`` stop every request that does not set
    ``ignore_eos``.

    [Note: prefill cap default] The scheduler itself caps nothing unless told;
    zserve (``ServerConfig``, ``--max-prefill-tokens-per-step``) tells it 96.
    Prompt tokens are what a decoding step can least afford: on the H100 with
    the Llama-8B shape a step of ~12 decodes took 11.7 ms, with one 128-token
    prompt 13.4 ms, with two 16.5 ms, with three 21.2 ms (session 5 step logs),
    since past ~100 rows the matmuls leave the memory-bound regime. With 96 no
    decoding step took longer than 14.1 ms, and inter-token gaps seen by the
    client went from p99/p50 1.45 / 1.73 (no cap) to 1.19 / 1.16 at 0.5 / 0.8 of
    saturation in the same run (benchmarks/RESULTS.md). Caps of 32 and 64 cost
    more than they gave while a chunk after a cached prefix ran eager masked
    attention; with the Triton slot attention they have not been re-measured.

    [Note: prefill pacing] A fixed cap still makes two kinds of step below
    saturation: most decode only, and one now and then carries a full cap of
    prompt tokens, so the client's inter-token gaps are bimodal and their p99
    is the capped step's time (H100, Llama-8B shape, batch 32: 11.3 ms decode
    only, 12.8 ms with up to 96 prompt tokens; session 6). With pacing a
    step's allowance is the prompt tokens still to feed (waiting prompts and
    the rest of those being fed) divided by ``prefill_pacing_steps``, at least
    :data:`PACING_MIN_CHUNK`, at most the cap: a lone 128-token prompt goes in
    as four 32-token chunks, which keep the step's rows in the matmuls'
    memory-bound range where they cost little, and when prompts arrive faster
    the allowance grows with what is pending, up to the cap; a backlog lifts
    both (as above). Time to first token grows by the extra steps. zserve
    uses 2: a lone 128-token prompt then goes in as 64 + 64 instead of 96 +
    32, the same two steps. Measured (H100, Llama-8B shape, batch 32, cap 96,
    client's inter-token p99/p50 at 0.5 / 0.8 of saturation; session 6 runs
    7-9 of benchmarks/RESULTS.md, steady host): pacing 2 1.18 / 1.16, 1.17 /
    1.18, 1.19 / 1.20; none 1.21 / 1.16, 1.19 / 1.15, 1.23 / 1.15; pacing 4
    1.16 / 1.15, 1.18 / 1.24. Capped steps got cheaper (median 12.1 vs 12.5
    ms) and median time to first token went from 36 to 48 ms (pacing 4: 67).
    """

    max_batch_size: int = 8
    max_num_batched_tokens: int = 2048
    max_queue_size: int = 128
    max_queue_delay_ms: float = 0.0
    max_prefill_tokens_per_step: int | None = None
    prefill_pacing_steps: int | None = None
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}): every running sequence decodes one token per step"
            )
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            raise ValueError(f"max_prefill_tokens_per_step must be >= 1 (or None for no cap), "
                             f"got {self.max_prefill_tokens_per_step}")
        if self.prefill_pacing_steps is not None and self.prefill_pacing_steps < 1:
            raise ValueError(f"prefill_pacing_steps must be >= 1 (or None for no pacing), "
                             f"got {self.prefill_pacing_steps}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1 (every request queues first), got {self.max_queue_size}")
        if self.max_queue_delay_ms < 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Feed ``token_ids`` (prompt positions ``start`` onward) into the sequence's cache.

    On the chunk that completes the prompt (``is_last``) the runner samples the
    sequence's first new token.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start: int
    is_last: bool
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class DecodeItem:
    """Feed ``token_id`` at ``position`` and sample the next token."""

    seq_id: int
    token_id: int
    position: int
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's work for the runner.

    ``freed_seq_ids`` are sequences that finished since the last step and that
    the runner has seen; the engine loop calls ``runner.free`` on each before
    running the step.
    """

    step: int
    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[DecodeItem, ...] = ()
    freed_seq_ids: tuple[int, ...] = ()

    @property
    def has_work(self) -> bool:
        return bool(self.prefills or self.decodes)

    @property
    def batch_size(self) -> int:
        return len(self.prefills) + len(self.decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)

    @property
    def sampled_seq_ids(self) -> tuple[int, ...]:
        """Sequences that get a new token this step: all decodes, and prompts that complete."""
        return tuple(c.seq_id for c in self.prefills if c.is_last) + tuple(d.seq_id for d in self.decodes)


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What the runner produced for a :class:`SchedulerOutput`.

    ``new_token_ids`` maps every sequence in ``sampled_seq_ids`` to its new
    token(s) (usually one). ``failed`` maps sequences the runner could not run
    to an error message; they finish as ``FAILED``, the rest of the batch goes on.
    """

    new_token_ids: Mapping[int, Seq[int]]
    failed: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SequenceEvent:
    """Something a client should hear: new tokens and text, and/or the end.

    ``text`` may lag ``token_ids`` (see [Note: text holdback] in
    ``sequence.py``); the last event of a sequence (``finished``) flushes it.
    """

    request_id: str
    seq_id: int
    token_ids: tuple[int, ...]
    text: str
    status: SequenceStatus
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status.is_finished


class Scheduler:
    """FCFS continuous batching under batch-size, token and KV limits.

    Args:
        config: the limits.
        clock: seconds, monotonic; injectable for tests. Deadlines and every
            reported time are on this clock (see :meth:`now`).
        kv_capacity: how many KV entries fit (see :data:`KVCapacity`);
            None means no limit.
        detokenize: token ids -> text, for text pieces and stop strings;
            without it events carry no text and stop strings are refused.
        observer: told about rejections, queue sizes, steps and finished
            requests, for metrics.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        clock: Clock = time.monotonic,
        kv_capacity: KVCapacity | None = None,
        detokenize: Detokenize | None = None,
        observer: StatsObserver | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._kv_capacity: KVCapacity = kv_capacity or (lambda: None)
        self._detokenize = detokenize
        self._observer: StatsObserver = observer or NullObserver()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}
        self._seq_of_request: dict[str, int] = {}
        self._next_seq_id = itertools.count()
        self._step = 0
        self._kv_reserved = 0
        self._accepting = True
        self._in_flight: SchedulerOutput | None = None
        self._queue_times: list[float] = []  # admissions since the last update
        self._to_free: list[int] = []
        self._events: list[SequenceEvent] = []
        self._published: tuple[int, int] | None = None

    # -- state -----------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def kv_reserved(self) -> int:
        return self._kv_reserved

    # -- clients ---------------------------------------------------------------
    def add_request(self, request: Request) -> int:
        """Queues a request; returns its sequence id.

        Raises at once, queueing nothing: :class:`InvalidRequestError` /
        :class:`RequestTooLongError` if it can never run,
        :class:`DuplicateRequestError` if its id is in flight,
        :class:`DrainingError` after :meth:`drain`, :class:`QueueFullError`
        when ``max_queue_size`` requests are waiting.
        """
        try:
            seq = self._new_sequence(request)
            self._check_admissible(request)
        except ServeError as err:
            self._observer.on_request_rejected(err.reason)
            raise
        self._waiting.append(seq)
        self._live[seq.seq_id] = seq
        self._seq_of_request[request.request_id] = seq.seq_id
        self._publish_queue()
        return seq.seq_id

    def _new_sequence(self, request: Request) -> Sequence:
        cfg, prompt_len = self.config, request.prompt_len
        max_output = request.sampling.max_new_tokens
        if cfg.max_model_len is not None:
            if prompt_len >= cfg.max_model_len:
                raise RequestTooLongError(
                    "prompt", f"{prompt_len} tokens leave no room to generate", limit=cfg.max_model_len - 1
                )
            max_output = min(max_output, cfg.max_model_len - prompt_len)
        if request.sampling.stop and self._detokenize is None:
            raise InvalidRequestError("stop", "stop strings need a detokenizer; this server has none")
        if not cfg.enable_chunked_prefill and prompt_len > cfg.max_num_batched_tokens:
            raise RequestTooLongError(
                "prompt", f"{prompt_len} tokens exceed the step's token budget", limit=cfg.max_num_batched_tokens
            )
        seq = Sequence(
            next(self._next_seq_id), request, arrival_time=self.now(), max_output_tokens=max_output,
            eos_token_ids=cfg.eos_token_ids, detokenize=self._detokenize,
        )
        capacity = self._kv_capacity()
        if capacity is not None and seq.kv_reservation > capacity:
            raise RequestTooLongError(
                "prompt", f"prompt + max_new_tokens need {seq.kv_reservation} KV entries", limit=capacity
            )
        return seq

    def _check_admissible(self, request: Request) -> None:
        if request.request_id in self._seq_of_request:
            raise DuplicateRequestError(f"request {request.request_id!r} is already in flight")
        if not self._accepting:
            raise DrainingError("the server is draining and takes no new requests")
        if len(self._waiting) >= self.config.max_queue_size:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue_size)")

    def cancel(self, request_id: str) -> bool:
        """Ends a request as ``CANCELLED`` (``EXPIRED`` if its deadline has passed: the RPC's deadline cancels it
        too); its batch slot is free at the next step.

        Returns False if no such request is in flight (unknown or finished).
        """
        seq_id = self._seq_of_request.get(request_id)
        if seq_id is None:
            return False
        seq, now = self._live[seq_id], self.now()
        expired = seq.request.deadline is not None and now >= seq.request.deadline
        seq.finish(SequenceStatus.EXPIRED if expired else SequenceStatus.CANCELLED, now)
        self._retire(seq, ())
        self._publish_queue()
        return True

    def drain(self) -> None:
        """Stops admission of new requests; those already accepted still run to the end."""
        self._accepting = False

    def pop_events(self) -> list[SequenceEvent]:
        """Events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def next_wakeup(self) -> float | None:
        """When, on the clock, an idle :meth:`schedule` may next have work: a
        queue delay running out or a deadline passing. None if neither."""
        times = [s.request.deadline for s in self._live.values() if s.request.deadline is not None]
        delay = self.config.max_queue_delay_ms / 1e3
        if self._waiting and delay > 0:
            times.append(self._waiting[0].arrival_time + delay)
        return min(times, default=None)

    # -- the engine's step -----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Picks this step's batch (see [Note: admission]).

        A returned output with work must be answered by :meth:`update` or
        :meth:`abort_step` before the next call.
        """
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update()/abort_step() of the last step")
        now = self.now()
        self._expire(now)
        budget = self.config.max_num_batched_tokens
        decodes = tuple(self._decode_item(s) for s in self._running if not s.is_prefilling)
        budget -= len(decodes)
        cap = self.config.max_prefill_tokens_per_step
        if decodes and cap is not None and not self._backlog():
            budget = min(budget, self._paced(cap))  # keep this step's prefill small (see the config)
        prefills = []
        for seq in self._running:
            if seq.is_prefilling and budget > 0:
                prefills.append(self._prefill_chunk(seq, budget))
                budget -= len(prefills[-1].token_ids)
        prefills += self._admit(now, budget)
        out = SchedulerOutput(self._step + 1, tuple(prefills), decodes, tuple(self._to_free))
        self._to_free.clear()
        if out.has_work:
            self._step += 1
            self._in_flight = out
        self._publish_queue()
        return out

    def _paced(self, cap: int) -> int:
        """This step's prompt-token allowance under ``cap`` (see [Note: prefill pacing])."""
        steps = self.config.prefill_pacing_steps
        if steps is None:
            return cap
        pending = sum(s.prompt_len - s.num_computed_tokens for s in self._running if s.is_prefilling)
        pending += sum(s.prompt_len for s in self._waiting)
        return min(cap, max(PACING_MIN_CHUNK, -(-pending // steps)))

    def _backlog(self) -> bool:
        """More requests wait than can be admitted at once, or than an eighth of the batch (see the config)."""
        waiting, size = len(self._waiting), self.config.max_batch_size
        return waiting > size - len(self._running) or waiting > max(1, size // 8)

    def _admit(self, now: float, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        if not self._admission_open(now, budget):
            return chunks
        capacity = self._kv_capacity()
        while self._waiting and len(self._running) < self.config.max_batch_size and budget > 0:
            seq = self._waiting[0]
            if capacity is not None and self._kv_reserved + seq.kv_reservation > capacity:
                break
            if not self.config.enable_chunked_prefill and seq.prompt_len > budget:
                break
            self._waiting.popleft()
            seq.admit(now)
            self._running.append(seq)
            self._kv_reserved += seq.kv_reservation
            self._queue_times.append(now - seq.arrival_time)
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= len(chunks[-1].token_ids)
        return chunks

    def _admission_open(self, now: float, budget: int) -> bool:
        """See [Note: queue delay]."""
        delay = self.config.max_queue_delay_ms / 1e3
        if not self._waiting or delay <= 0 or not self._accepting:
            return bool(self._waiting)
        if now - self._waiting[0].arrival_time >= delay:
            return True
        free_slots = self.config.max_batch_size - len(self._running)
        return len(self._waiting) >= free_slots or sum(s.prompt_len for s in self._waiting) >= budget

    @staticmethod
    def _prefill_chunk(seq: Sequence, budget: int) -> PrefillChunk:
        start = seq.num_computed_tokens
        end = min(seq.prompt_len, start + budget)
        seq.seen_by_runner = True
        tokens = seq.request.prompt_token_ids[start:end]
        return PrefillChunk(seq.seq_id, tokens, start, end == seq.prompt_len, seq.request.sampling)

    @staticmethod
    def _decode_item(seq: Sequence) -> DecodeItem:
        position = seq.prompt_len + len(seq.output_token_ids) - 1
        return DecodeItem(seq.seq_id, seq.output_token_ids[-1], position, seq.request.sampling)

    def update(self, output: RunnerOutput) -> None:
        """Applies the runner's output for the step :meth:`schedule` returned last.

        Advances each sequence's cache position, appends new tokens, checks
        stop conditions, retires finished sequences and queues their events.
        Tokens for sequences cancelled or expired meanwhile are dropped.
        """
        batch = self._take_in_flight()
        now = self.now()
        for chunk in batch.prefills:
            self._advance(chunk.seq_id, len(chunk.token_ids))
        for item in batch.decodes:
            self._advance(item.seq_id, 1)
        for seq_id, error in output.failed.items():
            self._fail(seq_id, error, now)
        ttfts: list[float] = []
        itls: list[float] = []
        generated = 0
        for seq_id in batch.sampled_seq_ids:
            seq = self._live.get(seq_id)
            tokens = output.new_token_ids.get(seq_id)
            if seq is not None and not tokens:
                self._fail(seq_id, "the runner returned no token for this sequence", now)
            elif seq is not None:
                first = seq.first_token_time is None
                generated += self._append(seq, tokens, now)
                if first:
                    ttfts.append(now - seq.arrival_time)
                else:
                    itls.append(seq.inter_token_latencies[-1])
        self._report_step(batch, generated, ttfts, itls)

    def _append(self, seq: Sequence, tokens: Seq[int], now: float) -> int:
        appended = seq.append_tokens(tokens, now)
        if seq.status.is_finished:
            self._retire(seq, appended)
        else:
            self._emit(seq, appended)
        return len(appended)

    def abort_step(self, error: str) -> None:
        """The runner failed the whole step: every sequence in it ends ``FAILED``."""
        batch = self._take_in_flight()
        now = self.now()
        for seq_id in {c.seq_id for c in batch.prefills} | {d.seq_id for d in batch.decodes}:
            self._fail(seq_id, error, now)
        self._report_step(batch, 0, [], [])

    def abort_all(self, error: str) -> None:
        """Ends every request in flight as ``FAILED`` (the engine is stopping)."""
        self._in_flight = None
        now = self.now()
        for seq_id in list(self._live):
            self._fail(seq_id, error, now)
        self._publish_queue()

    # -- internals ---------------------------------------------------------------
    def _take_in_flight(self) -> SchedulerOutput:
        batch, self._in_flight = self._in_flight, None
        if batch is None:
            raise RuntimeError("no step in flight: call schedule() first")
        return batch

    def _advance(self, seq_id: int, num_tokens: int) -> None:
        seq = self._live.get(seq_id)
        if seq is not None:
            seq.num_computed_tokens += num_tokens

    def _expire(self, now: float) -> None:
        for seq in [*self._waiting, *self._running]:
            deadline = seq.request.deadline
            if deadline is not None and now >= deadline:
                seq.finish(SequenceStatus.EXPIRED, now)
                self._retire(seq, ())

    def _fail(self, seq_id: int, error: str, now: float) -> None:
        seq = self._live.get(seq_id)
        if seq is not None:
            seq.finish(SequenceStatus.FAILED, now, error)
            self._retire(seq, ())

    def _retire(self, seq: Sequence, new_tokens: Seq[int]) -> None:
        """Removes a finished sequence, returns its slot and KV reservation, tells the client."""
        if seq.admitted_time is None:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
            self._kv_reserved -= seq.kv_reservation
        del self._live[seq.seq_id]
        del self._seq_of_request[seq.request_id]
        if seq.seen_by_runner:
            self._to_free.append(seq.seq_id)
        self._emit(seq, new_tokens)
        self._observer.on_request_finished(_request_stats(seq))

    def _emit(self, seq: Sequence, new_tokens: Seq[int]) -> None:
        text = seq.release_text()
        self._events.append(SequenceEvent(seq.request_id, seq.seq_id, tuple(new_tokens), text, seq.status, seq.error))

    def _report_step(self, batch: SchedulerOutput, generated: int, ttfts: list[float], itls: list[float]) -> None:
        stats = StepStats(
            step=batch.step, batch_size=batch.batch_size, num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=len(batch.decodes), num_generated_tokens=generated,
            queue_times=tuple(self._queue_times), times_to_first_token=tuple(ttfts),
            inter_token_latencies=tuple(itls),
        )
        self._queue_times.clear()
        self._observer.on_step(stats)
        self._publish_queue()

    def _publish_queue(self) -> None:
        sizes = (len(self._running), len(self._waiting))
        if sizes != self._published:
            self._published = sizes
            self._observer.on_queue_changed(*sizes)


def _request_stats(seq: Sequence) -> RequestStats:
    assert seq.finished_time is not None
    return RequestStats(
        request_id=seq.request_id,
        status=seq.status.value,
        prompt_tokens=seq.prompt_len,
        generated_tokens=len(seq.output_token_ids),
        queue_time=None if seq.admitted_time is None else seq.admitted_time - seq.arrival_time,
        time_to_first_token=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
        e2e_latency=seq.finished_time - seq.arrival_time,
        inter_token_latencies=tuple(seq.inter_token_latencies),
    )
