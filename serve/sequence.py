"""One request's life inside the scheduler: its state, tokens, text and times."""
from __future__ import annotations

import enum
from typing import Callable, Sequence as Seq

from .request import Request

Detokenize = Callable[[Seq[int]], str]
"""Decodes token ids to text (e.g. a Hugging Face tokenizer's ``decode`` with
``skip_special_tokens=True``). Pure Python; the scheduler calls it per step."""


class SequenceStatus(enum.Enum):
    """Where a sequence is. The values double as metric labels."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stopped"  # EOS, a stop token sequence or a stop string
    FINISHED_LENGTH = "length"  # max_new_tokens or the model's length
    CANCELLED = "cancelled"  # the client went away or asked to stop
    EXPIRED = "deadline_exceeded"  # its deadline passed
    FAILED = "failed"  # the runner failed on it

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class TextStream:
    """Incremental detokenization of a sequence's output, with stop strings.

    [Note: text holdback] Text is released to the client only when it is
    final. Two things can change the tail of the decoded text: a token that
    ends in the middle of a UTF-8 character (the decoder yields U+FFFD until the
    next token completes it), and a stop string that has begun but not yet
    ended (it must never reach the client). So the decode window waits while
    it ends in U+FFFD, and the last ``len(longest stop string) - 1`` characters
    are held back until the next step or the end. Decoding uses a sliding
    window (``_prefix_at``/``_read_at``) so that tokenizers whose pieces depend
    on their left neighbour (SentencePiece's leading spaces) decode right and
    each step costs a few tokens, not the whole output.
    """

    def __init__(self, detokenize: Detokenize, stop: tuple[str, ...]) -> None:
        self._detokenize = detokenize
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._prefix_at = 0
        self._read_at = 0
        self._released = 0
        self.text = ""
        self.stopped = False  # a stop string matched; the text is final

    def extend(self, output_ids: Seq[int], *, flush: bool = False) -> bool:
        """Decodes what ``output_ids`` added; returns True if a stop string matched."""
        if self.stopped:
            return True
        prefix = self._detokenize(output_ids[self._prefix_at : self._read_at])
        full = self._detokenize(output_ids[self._prefix_at :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
            return False
        self._prefix_at, self._read_at = self._read_at, len(output_ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += full[len(prefix) :]
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def release(self, *, final: bool) -> str:
        """The text that became final since the last call."""
        end = len(self.text) if final else max(self._released, len(self.text) - self._holdback)
        piece, self._released = self.text[self._released : end], end
        return piece


class Sequence:
    """The scheduler's record of one request (one request is one sequence).

    Token bookkeeping: the runner's KV cache holds ``num_computed_tokens`` of
    ``prompt + output``. While that is below the prompt length the sequence is
    *prefilling*; afterwards each step feeds back the last output token.
    """

    def __init__(
        self,
        seq_id: int,
        request: Request,
        *,
        arrival_time: float,
        max_output_tokens: int,
        eos_token_ids: frozenset[int],
        detokenize: Detokenize | None,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.status = SequenceStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.max_output_tokens = max_output_tokens
        self.error: str | None = None
        self.seen_by_runner = False
        self._eos = frozenset() if request.sampling.ignore_eos else eos_token_ids
        self._text = TextStream(detokenize, request.sampling.stop) if detokenize else None
        # Times on the scheduler's clock; None until they happen.
        self.arrival_time = arrival_time
        self.admitted_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.inter_token_latencies: list[float] = []  # one per step that brought tokens, after the first
        self.finished_time: float | None = None

    # -- shape ---------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prompt_len

    @property
    def kv_reservation(self) -> int:
        """The most KV entries this sequence can ever need (the last token is never fed back)."""
        return self.prompt_len + self.max_output_tokens - 1

    @property
    def text(self) -> str:
        return self._text.text if self._text else ""

    # -- lifecycle -----------------------------------------------------------
    def admit(self, now: float) -> None:
        self.status = SequenceStatus.RUNNING
        self.admitted_time = now

    def append_tokens(self, token_ids: Seq[int], now: float) -> list[int]:
        """Appends new tokens up to the first stop; returns those appended.

        Finishes the sequence (``FINISHED_STOPPED`` / ``FINISHED_LENGTH``) when
        a stop condition holds; tokens after the stopping one are dropped.
        """
        appended: list[int] = []
        for token in token_ids:
            self.output_token_ids.append(token)
            appended.append(token)
            status = self._stop_status(token)
            if status is not None:
                self.finish(status, now)
                break
        if appended:
            if self.first_token_time is None:
                self.first_token_time = now
            else:
                self.inter_token_latencies.append(now - self.last_token_time)
            self.last_token_time = now
        return appended

    def _stop_status(self, token: int) -> SequenceStatus | None:
        out = self.output_token_ids
        stopped = token in self._eos or any(
            len(out) >= len(s) and tuple(out[-len(s) :]) == s for s in self.request.sampling.stop_token_ids
        )
        if self._text is not None and self._text.extend(out):
            stopped = True
        if stopped:
            return SequenceStatus.FINISHED_STOPPED
        if len(out) >= self.max_output_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, status: SequenceStatus, now: float, error: str | None = None) -> None:
        assert status.is_finished, status
        if self._text is not None:
            self._text.extend(self.output_token_ids, flush=True)
        self.status = status
        self.error = error
        self.finished_time = now

    def release_text(self) -> str:
        """Text that became final since the last call ('' without a detokenizer)."""
        if self._text is None:
            return ""
        return self._text.release(final=self.status.is_finished)
