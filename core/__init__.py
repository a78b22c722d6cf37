"""zspeed.core: the one sharding/offload mechanism that training and serving share.

- :mod:`~zspeed.core.device`: ``DeviceHandle``, the only place that touches ``torch.cuda``.
- :mod:`~zspeed.core.topology`: ``Topology``, ranks and process groups, passed explicitly.
- :mod:`~zspeed.core.partition`: ``FlatPartition``, bucket-major flat buffers sharded over ranks.
- :mod:`~zspeed.core.comm`: bucketed, asynchronous ``all_gather`` / ``reduce_scatter`` over a partition.
- :mod:`~zspeed.core.store`: ``TensorStore`` on three tiers (device, pinned CPU, disk files).
- :mod:`~zspeed.core.streamer`: ``Streamer``, K device slots fed from a store with prefetch.
- :mod:`~zspeed.core.memory`: the ZeRO memory formulas and measured bytes.
"""
