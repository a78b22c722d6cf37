"""zspeed: sharding, offload, compression and serving on less GPU memory."""
__version__ = "0.1.0"
