"""``zspeed.serve.Client``: a small Python client of a ``zserve`` server.

::

    from zspeed.serve import Client

    with Client("127.0.0.1:50051", token="...") as client:
        print(client.generate("Once upon a time", max_new_tokens=32).text)
        for chunk in client.generate_stream([1, 2, 3], max_new_tokens=8):
            print(chunk.token_ids, chunk.text)

Errors are ``grpc.RpcError`` with the server's status code and message.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._proto import serve_pb2, serve_pb2_grpc

# What a server that is still starting answers a health check with (NOT_FOUND: the service is not set yet).
_NOT_READY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished generation (or, from :meth:`Client.generate_stream`, one piece of it).

    ``finish_reason`` is ``"stop"``, ``"length"``, ... on a finished one and
    ``""`` on stream pieces before the last.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_message(cls, msg) -> Completion:
        reason = "" if msg.finish_reason == serve_pb2.FINISH_REASON_UNSPECIFIED else (
            serve_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower())
        return cls(msg.request_id, tuple(msg.token_ids), msg.text, reason, msg.usage.prompt_tokens,
                   msg.usage.completion_tokens)


class Client:
    """A connection to a server at ``target`` (``host:port``).

    Args:
        token: bearer token sent as ``authorization`` metadata.
        tls: use TLS; ``root_certificates`` (PEM bytes or a file path) trusts a
            private CA or self-signed certificate, None uses the system roots.
        server_name: the name to check the certificate against, if not the host.
        timeout: default deadline of each call, seconds (None: none).
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | os.PathLike | None = None, server_name: str | None = None,
                 timeout: float | None = None, max_message_bytes: int = 4 << 20) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_reconnect_backoff_ms", 1000)]  # see a server that comes up within a second
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls or root_certificates is not None:
            roots = root_certificates
            if roots is not None and not isinstance(roots, bytes):
                roots = Path(roots).read_bytes()
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = serve_pb2_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **options) -> Completion:
        """Generates a completion of ``prompt`` (text, or token ids) and returns it whole.

        ``options``: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
        ``seed``, ``stop`` (strings), ``stop_token_ids`` (id sequences),
        ``ignore_eos``, ``request_id``.
        """
        response = self._stub.Generate(build_request(prompt, **options), timeout=self._deadline(timeout),
                                       metadata=self._metadata)
        return Completion.from_message(response)

    def generate_stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                        **options) -> Iterator[Completion]:
        """Like :meth:`generate`, yielding pieces as they are generated; the last has the finish reason.

        Closing the iterator early (``break``) cancels the request on the server.
        """
        call = self._stub.GenerateStream(build_request(prompt, **options), timeout=self._deadline(timeout),
                                         metadata=self._metadata)
        try:
            for msg in call:
                yield Completion.from_message(msg)
        finally:
            call.cancel()

    def model_info(self, *, timeout: float | None = None) -> serve_pb2.ModelInfoResponse:
        return self._stub.ModelInfo(serve_pb2.ModelInfoRequest(), timeout=self._deadline(timeout),
                                    metadata=self._metadata)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name, e.g. ``"SERVING"`` or ``"NOT_SERVING"``."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=self._deadline(timeout), metadata=self._metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_ready(self, timeout: float, *, on_wait: Callable[[str], None] | None = None) -> str | None:
        """Waits up to ``timeout`` seconds for the server's health to be ``SERVING`` (it may still be loading).

        Returns None once it is, else why not (the last error or status). ``on_wait(why)`` is called once,
        if the first check finds it not ready. Errors other than not-yet-reachable ones are raised.
        """
        deadline = time.monotonic() + timeout
        first = True
        while True:
            left = deadline - time.monotonic()
            try:
                response = self._health.Check(health_pb2.HealthCheckRequest(), timeout=max(min(left, 1.0), 0.05),
                                              wait_for_ready=not first)
                why = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                if why == "SERVING":
                    return None
            except grpc.RpcError as e:
                if e.code() not in _NOT_READY_CODES:
                    raise
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or first:  # keep the telling reason (refused, ...)
                    why = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                return why
            if first and on_wait is not None:
                on_wait(why)
            first = False
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout


def build_request(prompt: str | Sequence[int], *, max_new_tokens: int = 0, temperature: float = 0.0, top_k: int = 0,
                  top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[Sequence[int]] = (), ignore_eos: bool = False,
                  request_id: str = "") -> serve_pb2.GenerateRequest:
    """The ``GenerateRequest`` for ``prompt`` and options (see :meth:`Client.generate`)."""
    sampling = serve_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    msg = serve_pb2.GenerateRequest(request_id=request_id, sampling=sampling, max_new_tokens=max_new_tokens,
                                    stop=list(stop), ignore_eos=ignore_eos,
                                    stop_token_ids=[serve_pb2.TokenIds(ids=list(s)) for s in stop_token_ids])
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.SetInParent()  # marks the oneof even for an empty list (which the server then refuses)
        msg.token_ids.ids.extend(prompt)
    return msg
