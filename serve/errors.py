"""Errors the serving stack raises at a caller, each tied to one gRPC status.

The scheduler and the engine loop know nothing of gRPC; each error carries the
*name* of the status it stands for (``grpc_status``), and the servicer maps it
with ``getattr(grpc.StatusCode, err.grpc_status)``. ``reason`` is the short
label the metrics use for rejected requests.
"""
from __future__ import annotations

from typing import ClassVar


class ServeError(Exception):
    """Base of the errors a request can be refused or failed with."""

    grpc_status: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "error"

    def __reduce__(self):
        # Subclasses take other constructor arguments than their message; pickle (the engine process
        # sends refusals to the gRPC process) rebuilds them from the message and their fields instead.
        return _rebuild, (type(self), str(self), dict(self.__dict__))


def _rebuild(cls: type[ServeError], message: str, fields: dict) -> ServeError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(fields)
    return err


class InvalidRequestError(ServeError, ValueError):
    """A request field is malformed; ``field`` names it."""

    grpc_status = "INVALID_ARGUMENT"
    reason = "invalid"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestTooLongError(InvalidRequestError):
    """The request is well formed but exceeds a limit; ``limit`` says which."""

    grpc_status = "OUT_OF_RANGE"

    def __init__(self, field: str, message: str, *, limit: int) -> None:
        super().__init__(field, f"{message} (limit {limit})")
        self.limit = limit


class DuplicateRequestError(ServeError):
    """A request with this id is already in flight."""

    grpc_status = "ALREADY_EXISTS"
    reason = "duplicate"


class QueueFullError(ServeError):
    """The waiting queue is at its bound; raised at once, nothing is queued."""

    grpc_status = "RESOURCE_EXHAUSTED"
    reason = "queue_full"


class DrainingError(ServeError):
    """The server is draining (SIGTERM): it finishes what it has, takes nothing new."""

    grpc_status = "UNAVAILABLE"
    reason = "draining"


class EngineStoppedError(ServeError):
    """The engine loop is not running, so it cannot take or finish requests."""

    grpc_status = "UNAVAILABLE"
    reason = "engine_stopped"
