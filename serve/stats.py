"""What the scheduler reports for metrics, as plain numbers.

The scheduler calls a :class:`StatsObserver` as things happen; the metrics
module (:class:`zspeed.serve.metrics.ServeMetrics`) is one, a test can be
another. All times are seconds on the scheduler's clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StepStats:
    """One scheduler step, reported when the runner's output is applied."""

    step: int
    batch_size: int  # sequences the runner ran this step
    num_prefill_tokens: int  # prompt tokens fed this step
    num_decode_tokens: int
    num_generated_tokens: int  # new tokens kept (after stops)
    queue_times: tuple[float, ...]  # arrival -> admission, for sequences admitted this step
    times_to_first_token: tuple[float, ...]  # arrival -> first token, for those that got it now
    inter_token_latencies: tuple[float, ...]  # previous token -> this one, per decoding sequence


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One finished request (any way it finished)."""

    request_id: str
    status: str  # a SequenceStatus value: "stopped", "length", "cancelled", ...
    prompt_tokens: int
    generated_tokens: int
    queue_time: float | None  # None if it never left the queue
    time_to_first_token: float | None
    e2e_latency: float  # arrival -> finish
    inter_token_latencies: tuple[float, ...]  # this request's, in order


class StatsObserver(Protocol):
    def on_request_rejected(self, reason: str) -> None:
        """A request was refused at admission (``ServeError.reason``)."""

    def on_queue_changed(self, num_running: int, num_waiting: int) -> None:
        """The number of running or waiting sequences changed."""

    def on_step(self, stats: StepStats) -> None:
        """A step's output was applied."""

    def on_request_finished(self, stats: RequestStats) -> None:
        """A request finished: stopped, hit its length, cancelled, expired or failed."""


class NullObserver:
    """Observes nothing."""

    def on_request_rejected(self, reason: str) -> None:
        pass

    def on_queue_changed(self, num_running: int, num_waiting: int) -> None:
        pass

    def on_step(self, stats: StepStats) -> None:
        pass

    def on_request_finished(self, stats: RequestStats) -> None:
        pass
