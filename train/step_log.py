"""Training progress on rank 0, every ``steps_per_print`` optimizer steps.

Logs through the ``zspeed.train`` logger: step, mean loss since the last line
(rank 0's micro-batches), learning rate, loss scale, gradient norm, skipped
steps, tokens/s over all ranks (samples/s when the input is not token ids), peak
memory (device memory on CUDA, the process's peak resident set on the CPU) and,
with ``wall_clock_breakdown``, the time spent in forward, backward and step.
"""
from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from typing import Any, Iterator

import torch

from ..core.memory import format_bytes
from ..core.topology import Topology

__all__ = ["StepLogger", "count_tokens"]

logger = logging.getLogger("zspeed.train")


def count_tokens(args: tuple, kwargs: dict[str, Any]) -> int:
    """Tokens in a forward's inputs: ``input_ids`` (keyword or first integer tensor), else samples."""
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(ids, torch.Tensor):
        return 0
    return ids.numel() if not ids.is_floating_point() else (ids.shape[0] if ids.dim() else 1)


def _peak_memory(topo: Topology) -> int:
    if topo.device.is_cuda:
        return topo.device.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class StepLogger:
    """Collects per-micro-batch facts and writes one line every ``steps_per_print`` steps."""

    def __init__(self, *, topo: Topology, steps_per_print: int, wall_clock_breakdown: bool = False):
        self.topo, self.steps_per_print, self.breakdown = topo, steps_per_print, wall_clock_breakdown
        self._times: dict[str, float] = {}
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._since = time.perf_counter()

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """With ``wall_clock_breakdown``: add the phase's wall time (device synchronised) to the next line."""
        if not self.breakdown:
            yield
            return
        self.topo.device.synchronize()
        start = time.perf_counter()
        yield
        self.topo.device.synchronize()
        self._times[phase] = self._times.get(phase, 0.0) + time.perf_counter() - start

    def on_forward(self, tokens: int) -> None:
        self._tokens += tokens

    def on_backward(self, loss: torch.Tensor) -> None:
        if self.topo.is_main:
            self._losses.append(loss.detach().float())

    def on_step(self, *, step: int, lr: list[float], loss_scale: float, grad_norm: float, skipped: int) -> None:
        if step % self.steps_per_print or not self.topo.is_main:
            self._drop_if_not_main()
            return
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        loss = torch.stack(self._losses).mean().item() if self._losses else float("nan")
        tokens_per_s = self._tokens * self.topo.world_size / elapsed
        times = "".join(f" | {k} {v * 1e3:.1f} ms" for k, v in self._times.items())
        logger.info("step %d | loss %.4f | lr %s | loss scale %g | grad norm %.4f | skipped %d | "
                    "tokens/s %.1f | peak memory %s%s", step, loss, ", ".join(f"{x:.3e}" for x in lr),
                    loss_scale, grad_norm, skipped, tokens_per_s, format_bytes(_peak_memory(self.topo)), times)
        self._times.clear()
        self._losses.clear()
        self._tokens = 0
        self._since = time.perf_counter()

    def _drop_if_not_main(self) -> None:
        if not self.topo.is_main:
            self._tokens = 0
            self._times.clear()
