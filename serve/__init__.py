"""zspeed.serve: continuous-batching inference server (scheduler, model runner, gRPC API, metrics).

``Client`` is imported lazily, so the pure-Python scheduler path does not import grpc.
"""
__all__ = ["Client", "Completion"]


def __getattr__(name: str):
    if name in ("Client", "Completion"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'zspeed.serve' has no attribute {name!r}")
