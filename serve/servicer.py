"""The gRPC servicer of ``zspeed.serve.v1.GenerationService``: messages in, engine calls, messages out.

Thin by design: :func:`to_request` turns a ``GenerateRequest`` into a
:class:`~zspeed.serve.request.Request` (tokenizing text, applying the
server's caps), the engine loop does the work, and finished handles become
responses. Every refusal is a :class:`~zspeed.serve.errors.ServeError`
whose ``grpc_status`` names the status code: ``INVALID_ARGUMENT`` naming the
field, ``OUT_OF_RANGE`` with the limit, ``RESOURCE_EXHAUSTED`` when the queue
is full, ``UNAVAILABLE`` while draining. The gRPC deadline becomes the
request's deadline; a client that goes away cancels its request.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterator, NoReturn

import grpc

from ._proto import serve_pb2, serve_pb2_grpc
from .engine_loop import EngineLoop, RequestHandle
from .errors import InvalidRequestError, RequestTooLongError, ServeError
from .request import Request, SamplingParams
from .sequence import SequenceStatus
from .stats import NullObserver, StatsObserver
from .tokenizer import Tokenizer

_NO_DEADLINE_S = 1e8  # time_remaining() beyond this means the client set none
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: serve_pb2.FINISH_REASON_STOP,
    SequenceStatus.FINISHED_LENGTH: serve_pb2.FINISH_REASON_LENGTH,
    SequenceStatus.CANCELLED: serve_pb2.FINISH_REASON_CANCELLED,
    SequenceStatus.EXPIRED: serve_pb2.FINISH_REASON_DEADLINE_EXCEEDED,
    SequenceStatus.FAILED: serve_pb2.FINISH_REASON_ERROR,
}
# How a request that did not complete ends its RPC.
_ABORT_CODES = {
    SequenceStatus.CANCELLED: grpc.StatusCode.CANCELLED,
    SequenceStatus.EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    SequenceStatus.FAILED: grpc.StatusCode.INTERNAL,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestLimits:
    """Caps on one request: prompt tokens, requested ``max_new_tokens``, and its default when 0."""

    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    default_max_new_tokens: int

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.max_prompt_tokens, self.max_new_tokens, self.default_max_new_tokens) < 1:
            raise ValueError(f"every request limit must be >= 1: {self}")
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(f"default_max_new_tokens={self.default_max_new_tokens} exceeds the cap "
                             f"max_new_tokens={self.max_new_tokens}")


def to_request(msg: serve_pb2.GenerateRequest, *, tokenizer: Tokenizer, limits: RequestLimits,
               deadline: float | None) -> Request:
    """Validates and translates a ``GenerateRequest``; raises :class:`ServeError` naming the field."""
    prompt = _prompt_ids(msg, tokenizer, limits)
    max_new = msg.max_new_tokens or limits.default_max_new_tokens
    if max_new > limits.max_new_tokens:
        raise RequestTooLongError("max_new_tokens", f"{max_new} requested", limit=limits.max_new_tokens)
    try:
        sampling = SamplingParams(
            temperature=msg.sampling.temperature, top_k=msg.sampling.top_k,
            top_p=msg.sampling.top_p if msg.sampling.HasField("top_p") else 1.0,
            seed=msg.sampling.seed if msg.sampling.HasField("seed") else None,
            max_new_tokens=max_new, stop=tuple(msg.stop),
            stop_token_ids=tuple(tuple(s.ids) for s in msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        )
    except InvalidRequestError as err:
        if err.field in _SAMPLING_FIELDS:
            raise InvalidRequestError(f"sampling.{err.field}", str(err).split(": ", 1)[1]) from None
        raise
    return Request(request_id=msg.request_id or uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling,
                   deadline=deadline)


def _prompt_ids(msg: serve_pb2.GenerateRequest, tokenizer: Tokenizer, limits: RequestLimits) -> tuple[int, ...]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "set either text or token_ids")
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("text", "must not be empty")
        ids = tuple(tokenizer.encode(msg.text))
    else:
        ids = tuple(msg.token_ids.ids)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if not ids:
        raise InvalidRequestError(kind, "must not be empty")
    if len(ids) > limits.max_prompt_tokens:
        raise RequestTooLongError("prompt", f"{len(ids)} tokens", limit=limits.max_prompt_tokens)
    return ids


def abort_with(context: grpc.ServicerContext, err: ServeError) -> NoReturn:
    """Ends the RPC with the status ``err`` stands for (raises)."""
    context.abort(getattr(grpc.StatusCode, err.grpc_status), str(err))
    raise AssertionError("context.abort returned")  # it raises; this keeps type checkers honest


class GenerationServicer(serve_pb2_grpc.GenerationServiceServicer):
    """``GenerationService`` over an :class:`EngineLoop`.

    ``observer`` is told about requests refused here (bad fields, caps), as
    the scheduler tells it about those it refuses.
    """

    def __init__(self, engine: EngineLoop, *, tokenizer: Tokenizer, limits: RequestLimits,
                 model_info: serve_pb2.ModelInfoResponse, observer: StatsObserver | None = None) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._limits = limits
        self._model_info = model_info
        self._observer = observer or NullObserver()

    def Generate(self, request: serve_pb2.GenerateRequest, context: grpc.ServicerContext):
        handle = self._submit(request, context)
        result = handle.result()
        _end_unfinished(context, result.status, result.error)
        return serve_pb2.GenerateResponse(
            request_id=result.request_id, token_ids=result.token_ids, text=result.text,
            finish_reason=FINISH_REASONS[result.status],
            usage=serve_pb2.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids)),
        )

    def GenerateStream(self, request: serve_pb2.GenerateRequest,
                       context: grpc.ServicerContext) -> Iterator[serve_pb2.GenerateStreamResponse]:
        handle = self._submit(request, context)
        generated = 0
        for event in handle.stream():
            generated += len(event.token_ids)
            if event.finished:
                _end_unfinished(context, event.status, event.error)
                yield serve_pb2.GenerateStreamResponse(
                    request_id=event.request_id, token_ids=event.token_ids, text=event.text,
                    finish_reason=FINISH_REASONS[event.status],
                    usage=serve_pb2.Usage(prompt_tokens=handle.request.prompt_len, completion_tokens=generated),
                )
            elif event.token_ids or event.text:
                yield serve_pb2.GenerateStreamResponse(request_id=event.request_id, token_ids=event.token_ids,
                                                       text=event.text)

    def ModelInfo(self, request: serve_pb2.ModelInfoRequest, context: grpc.ServicerContext):
        return self._model_info

    def _submit(self, msg: serve_pb2.GenerateRequest, context: grpc.ServicerContext) -> RequestHandle:
        try:
            request = to_request(msg, tokenizer=self._tokenizer, limits=self._limits, deadline=self._deadline(context))
        except ServeError as err:
            self._observer.on_request_rejected(err.reason)
            abort_with(context, err)
        try:
            handle = self._engine.submit(request)
        except ServeError as err:
            abort_with(context, err)
        # Runs when the RPC ends for any reason; cancels only if the request is still going
        # (the client went away or its deadline passed on the wire).
        if not context.add_callback(lambda: handle.done() or handle.cancel()):
            handle.cancel()
        return handle

    def _deadline(self, context: grpc.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        if remaining is None or remaining > _NO_DEADLINE_S:
            return None
        return self._engine.now() + max(remaining, 0.0)


def _end_unfinished(context: grpc.ServicerContext, status: SequenceStatus, error: str | None) -> None:
    """Aborts the RPC of a request that was cancelled, expired or failed."""
    code = _ABORT_CODES.get(status)
    if code is not None:
        context.abort(code, error or f"the request ended {status.value}")
