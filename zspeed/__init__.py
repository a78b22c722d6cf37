"""zspeed: sharding, offload, compression and serving on less GPU memory."""
__version__ = "0.1.0"

__all__ = ["initialize"]


def __getattr__(name: str):
    # Lazy: importing zspeed must not import torch.distributed machinery or transformers.
    if name == "initialize":
        from zspeed.train.initialize import initialize
        return initialize
    raise AttributeError(f"module 'zspeed' has no attribute {name!r}")
