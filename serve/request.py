"""What a client asks for: a prompt, how to sample, when to stop, by when.

Both dataclasses validate at construction and raise
:class:`~zspeed.serve.errors.InvalidRequestError` naming the offending field,
so a servicer can turn a bad message into ``INVALID_ARGUMENT`` by building one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidRequestError

_MAX_SEED = 2**64


def _token_tuple(name: str, ids: object) -> tuple[int, ...]:
    try:
        out = tuple(ids)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(name, "must be a sequence of token ids") from None
    if not out:
        raise InvalidRequestError(name, "must not be empty")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidRequestError(name, f"token ids must be non-negative ints, got {t!r}")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to pick each token and when to stop.

    ``temperature == 0`` is greedy (top-k/top-p are then ignored). ``seed``
    seeds the request's own generator, so a seeded request samples the same
    tokens whatever it is batched with. Generation stops at the first of: the
    model's EOS token (unless ``ignore_eos``), the output ending with one of
    ``stop_token_ids``, the decoded output containing one of ``stop`` (needs a
    detokenizer; the string is cut from the text), ``max_new_tokens`` tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 keeps all), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < _MAX_SEED:
            raise InvalidRequestError("seed", f"must be in [0, 2**64), got {self.seed}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        stops = tuple(_token_tuple("stop_token_ids", s) for s in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stops)
        strings = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in strings):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        object.__setattr__(self, "stop", strings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One generation request.

    ``deadline`` is an absolute time on the scheduler's clock
    (:meth:`Scheduler.now`); past it the request leaves the batch at the next
    step with status ``EXPIRED``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    deadline: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        object.__setattr__(self, "prompt_token_ids", _token_tuple("prompt", self.prompt_token_ids))
        if self.deadline is not None and not math.isfinite(self.deadline):
            raise InvalidRequestError("deadline", f"must be finite, got {self.deadline}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)
