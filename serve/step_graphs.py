"""A whole serving step's decoder layers as one CUDA graph, the Triton slot attention inside it.

[Note: whole-step graphs] With the piecewise graphs ([Note: piecewise graphs])
the host still launched, per layer and step, the attention's cache write and
kernel and the two graphs around them, and the engine thread was busy for the
whole step: on an H100 (session 6, Llama-8B shape, 32 layers) 2-3 % of steps
took 20-54 ms instead of 11.6 with the thread's CPU time equal to its wall
time, whatever slowed this virtual machine's CPU going straight into the
inter-token gaps. With the Triton slot attention ([Note: slot attention
kernel]) nothing in a layer needs the host: the cache write is an indexed copy
with device indices and the kernel reads its work items from device memory.
So every layer of a step is captured in one graph, per bucket of padded rows
``n`` (as the piecewise graphs) and per ``block_m`` of the kernel (1 for
decode-only steps, :data:`~zspeed.kernels.attention.BLOCK_M` with prompt
chunks). A step's host work is one copy of its indices and one replay plus what
surrounds the layers (embedding, output head, sampling: 1.3 ms of a 4.05 ms
step at 8 layers); the host then mostly waits on the device, and a stall that
falls while the device works costs nothing. Device time is what it was (the
same kernels; a 32-layer decode step at batch 32 took 11.2-11.3 ms against
11.6 piecewise), and greedy tokens equal the piecewise path's exactly (32/32
sequences, benchmarks/serve_step_profile.py --check).

What makes the shapes static: the indices live in one device buffer per bucket
``(slots: n, positions: n, work: 4n)``; the rows past the step's ``N`` write
their keys and values to the cache's scratch slot (``KVCache.scratch_slot``,
never given to a sequence), and their work items have no rows, so the kernel's
programs for them store nothing (every item has at least one row, so ``n``
items always suffice). Padded rows start from zeros and are never read by a
real row: every other operation of a layer is row by row.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from zspeed.kernels.attention import BLOCK_M as CHUNK_BLOCK_M

from .kv_cache import KVCache
from .piecewise import Buffers, PiecewiseLayers

log = logging.getLogger("zspeed.serve")

DECODE_BLOCK_M = 1  # the kernel's rows per work item in decode-only steps


class StepGraphs:
    """Runs the decoder stack of a step as one graph (see [Note: whole-step graphs]).

    ``pieces`` supplies the layer halves, the bucket sizes and each bucket's
    activation buffers (its own graphs are not captured); ``cache`` must have a
    scratch slot. Decode-only graphs are captured for buckets up to
    ``max_batch_size`` rows, graphs with prompt chunks for every bucket. With
    ``capture`` False (no CUDA) the same padded step runs eagerly, which is how
    CPU tests check it.
    """

    def __init__(self, pieces: PiecewiseLayers, cache: KVCache, *, capture: bool, max_batch_size: int) -> None:
        if cache.scratch_slot is None:
            raise ValueError("whole-step graphs need a KV cache with a scratch slot (KVCacheConfig.scratch_slots=1)")
        self.pieces, self.cache, self.capture = pieces, cache, capture
        self.buckets = pieces.buckets
        decode_top = pieces.bucket(min(max_batch_size, self.buckets[-1]))
        self._variants = [(n, DECODE_BLOCK_M) for n in self.buckets if n <= decode_top]
        self._variants += [(n, CHUNK_BLOCK_M) for n in self.buckets]
        self._index: dict[int, torch.Tensor] = {}  # bucket -> (6n,) long: slots, positions, work
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._scales = [layer.self_attn.scaling for layer in pieces.layers]
        self._device = pieces.device

    def capture_all(self) -> None:
        """Captures every variant's graph now (start-up), so no step pays for a capture."""
        if not self.capture:
            return
        start = time.perf_counter()
        # the first start with quantized layers also tunes their kernels for every bucket: minutes, so a bar
        # (tqdm's own choice: shown on a terminal, not in logs or under tests)
        with torch.inference_mode():
            for key in tqdm(self._variants, desc="CUDA graphs", unit="graph", disable=None):
                if key not in self._graphs:
                    self._capture(*key)
        log.info("whole-step graphs: %d (buckets of up to %d tokens) captured in %.1fs", len(self._graphs),
                 self.buckets[-1], time.perf_counter() - start)

    def fits(self, num_tokens: int) -> bool:
        return self.pieces.fits(num_tokens)

    def run(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], *, slots: Sequence[int],
            positions: Sequence[int], work: Sequence[int], block_m: int) -> torch.Tensor:
        """``hidden`` ``(1, N, hidden)`` through every layer. ``slots``/``positions``: each row's cache slot and
        position; ``work``: :func:`~zspeed.kernels.attention.attention_work` of the step's segments with
        ``block_m``. Returns ``(1, N, hidden)`` (a view of the bucket's buffer, valid until the next call)."""
        n_real = hidden.shape[1]
        n = self.pieces.bucket(n_real)
        if len(slots) != n_real or len(positions) != n_real or len(work) % 4 or len(work) > 4 * n_real:
            raise ValueError(f"a step of {n_real} rows needs {n_real} slots and positions and at most {n_real} "
                             f"work items; got {len(slots)}, {len(positions)} and {len(work) / 4:g}")
        bufs = self.pieces.load_inputs(hidden, rotary)
        scratch = self.cache.scratch_slot
        values = torch.tensor([*slots, *[scratch] * (n - n_real), *positions, *[0] * (n - n_real),
                               *work, *[0] * (4 * n - len(work))], dtype=torch.long)
        host = self._pinned(values)
        index = self._index_buffer(n)
        index.copy_(host, non_blocking=True)
        graph = self._graphs.get((n, block_m)) if self.capture else None
        if self.capture and graph is None:
            graph = self._capture(n, block_m)
        if graph is not None:
            graph.replay()
        else:
            self._layers(bufs, index, block_m)
        return bufs.hidden[:n_real][None]

    def _pinned(self, values: torch.Tensor) -> torch.Tensor:
        if self._device.type != "cuda":
            return values
        return torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values)

    # -- the graph's body ------------------------------------------------------------
    def _layers(self, bufs: Buffers, index: torch.Tensor, block_m: int) -> None:
        from zspeed.kernels.attention import slot_attention

        n = bufs.hidden.shape[0]
        slots, positions, work = index[:n], index[n:2 * n], index[2 * n:]
        cache = self.cache
        for i, layer in enumerate(self.pieces.layers):
            self.pieces.pre(layer, bufs)
            cache.write_tokens(i, slots, positions, bufs.k[0], bufs.v[0])
            out = slot_attention(bufs.q[0], cache.keys[i], cache.values[i], work, self._scales[i], block_m=block_m)
            bufs.attn_out.copy_(out.reshape(n, -1))
            self.pieces.post(layer, bufs)

    def _index_buffer(self, n: int) -> torch.Tensor:
        index = self._index.get(n)
        if index is None:
            index = self._index[n] = torch.zeros(6 * n, dtype=torch.long, device=self._device)
            index[:n] = self.cache.scratch_slot  # before any step: rows write the scratch slot, items are empty
        return index

    def _capture(self, n: int, block_m: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        bufs = self.pieces.bucket_buffers(n)
        index = self._index_buffer(n)
        saved = {name: getattr(bufs, name).clone() for name in ("hidden", "cos", "sin")}
        saved_index = index.clone()
        index[:n] = self.cache.scratch_slot  # the warm-up must not write a sequence's cache entries
        index[n:] = 0
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: library handles, workspaces, Triton compiles, outside capture
            self._layers(bufs, index, block_m)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._layers(bufs, index, block_m)
        for name, value in saved.items():  # the warm-up overwrote this step's inputs
            getattr(bufs, name).copy_(value)
        index.copy_(saved_index)
        self._graphs[(n, block_m)] = graph
        log.debug("captured the whole-step graph of %d rows (block_m %d) in %.2fs", n, block_m,
                  time.perf_counter() - start)
        return graph
