"""The model runner: runs one scheduler step on the device, layer by layer.

    plan      pack the step's prefill chunks and decode tokens into one row of tokens
    embed     token embeddings and rotary tables for that row
    layers    for each decoder layer: acquire (resident or streamed in), run on the
              whole batch, release (the next layers stream in meanwhile)
    sample    final norm and output head on the rows that get a token, then sample

The runner is the only serving component that touches torch; it implements
:class:`~zspeed.serve.engine_loop.Runner` and is called from the engine thread
only. Packing and attention: [Note: packed batch] in ``attention.py``; cache:
[Note: slot cache] in ``kv_cache.py``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from zspeed.kernels import HAS_TRITON, interpreting
from zspeed.kernels.attention import BLOCK_M as ATTENTION_BLOCK_M
from zspeed.kernels.attention import attention_work

from .attention import DecodeBatch, LayerAttention, Segment, chunk_mask
from .kv_cache import KVCache, KVCacheConfig
from .layers import ResidentLayers
from .model_loader import LoadedModel
from .piecewise import PiecewiseLayers, splittable
from .request import SamplingParams
from .sampling import Sampler
from .scheduler import RunnerOutput, SchedulerOutput
from .step_graphs import StepGraphs

log = logging.getLogger("zspeed.serve")

# [Note: no cuDNN attention] On Hopper, torch may run SDPA through cuDNN, which builds (and caches) an
# execution plan per shape. Serving changes the key length every step, so every call built a new plan
# on the host: measured on an H100 (torch 2.11, Llama-8B shape), 5.9 ms of host time per attention call,
# 71 ms per batch-1 decode step of 8 layers, against a few ms of GPU work. Flash and memory-efficient
# attention take any length without planning; the math kernel is the fallback (and the CPU's path).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RunnerObserver(Protocol):
    """Told the runner's figures after each step (:class:`~zspeed.serve.metrics.ServeMetrics` is one)."""

    def on_weights_streamed(self, num_bytes: int, stall_seconds: float = 0.0) -> None: ...

    def set_device_memory(self, num_bytes: int, *, kind: str = "allocated") -> None: ...


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step packed into a row of tokens (see [Note: packed batch])."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    slots: tuple[int, ...]  # each token's KV-cache slot
    segments: tuple[Segment, ...]
    sampled: tuple[tuple[int, SamplingParams], ...]  # (seq_id, params) per row of ``sample_rows``
    sample_rows: tuple[int, ...]


class ModelRunner:
    """Runs scheduler steps for a :class:`LoadedModel`.

    Args:
        model: what :func:`~zspeed.serve.model_loader.load_model` returned.
        max_batch_size: sequences at once (KV slots); the scheduler's ``max_batch_size``.
        max_model_len: prompt + output tokens of one sequence; the scheduler's ``max_model_len``.
        observer: told streamed bytes, stalls and device memory after each step.
        graphs: run resident layers as CUDA graphs: with the Triton attention kernel each step's layers as
            one graph ([Note: whole-step graphs]), else two graphs per layer around eager attention ([Note:
            piecewise graphs]). None (default) where the device is CUDA, the layers resident and of a
            Llama-family kind; True also elsewhere (without CUDA the same padded steps run eagerly: for
            tests); False never.
        attention_kernel: ``"triton"``: each layer's attention (decode tokens and prompt chunks) in one
            Triton kernel over the cache ([Note: slot attention kernel] in zspeed.kernels.attention; on a
            CPU only under ``TRITON_INTERPRET=1``); ``"sdpa"``: torch SDPA per prompt chunk and over a
            gathered batch of decodes; ``"auto"`` (default): Triton on a CUDA device when Triton is installed
            and the head size is a power of two, SDPA elsewhere.
        whole_step: with graphs and the Triton kernel, one graph per step (default); False: the piecewise
            graphs around the kernel (for comparisons).
    """

    def __init__(self, model: LoadedModel, *, max_batch_size: int, max_model_len: int,
                 observer: RunnerObserver | None = None, graphs: bool | None = None,
                 attention_kernel: str = "auto", whole_step: bool = True) -> None:
        if attention_kernel not in ("auto", "sdpa", "triton"):
            raise ValueError(f"attention_kernel must be 'auto', 'sdpa' or 'triton', got {attention_kernel!r}")
        desc = model.description
        if attention_kernel == "auto":
            pow2 = desc.head_dim & (desc.head_dim - 1) == 0
            attention_kernel = "triton" if HAS_TRITON and model.device.device.type == "cuda" and pow2 else "sdpa"
        self._attention_kernel = attention_kernel == "triton"
        self.attention_kernel = attention_kernel  # what runs: "sdpa" or "triton"
        if self._attention_kernel and not HAS_TRITON:
            raise ValueError("attention_kernel='triton' needs the triton package (pip install triton); or use 'sdpa'")
        if self._attention_kernel and model.device.device.type != "cuda" and not interpreting():
            raise ValueError("attention_kernel='triton' needs a CUDA device (or TRITON_INTERPRET=1 on a CPU)")
        if self._attention_kernel and desc.head_dim & (desc.head_dim - 1):
            raise ValueError(f"attention_kernel='triton' needs a power-of-two head_dim, the model has {desc.head_dim}")
        limit = min(desc.max_position_embeddings, desc.sliding_window or desc.max_position_embeddings)
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's {limit} positions"
                             + (" (its sliding window)" if desc.sliding_window == limit else ""))
        self.model = model
        self.device = model.device
        self.max_model_len = max_model_len
        split = self._split(graphs)
        whole = split and self._attention_kernel and whole_step  # [Note: whole-step graphs]
        self.cache = KVCache(KVCacheConfig(num_layers=desc.num_layers, num_kv_heads=desc.num_kv_heads,
                                           head_dim=desc.head_dim, slots=max_batch_size, max_len=max_model_len,
                                           dtype=desc.dtype, scratch_slots=int(whole)), device=model.device)
        self.sampler = Sampler(model.device.device)
        self._observer = observer
        self._pieces = self._whole = None
        if whole:
            self._whole = self._step_graphs(max_batch_size)
        elif split:
            self._pieces = self._piecewise()
        log.info("KV cache: %d slots x %d tokens, %.3g GB on %s", max_batch_size, max_model_len,
                 self.cache.config.nbytes / 1e9, self.device)

    def _split(self, graphs: bool | None) -> bool:
        """Whether the layers run as graphs (eagerly split without CUDA), as ``graphs`` asks."""
        layers, cuda = self.model.layers, self.device.device.type == "cuda"
        resident = isinstance(layers, ResidentLayers) and all(splittable(m) for m in layers.modules)
        if graphs is False or (graphs is None and not (cuda and resident)):
            return False
        if not resident:
            raise ValueError("graphs=True needs resident (--offload none) Llama-family decoder layers")
        return True

    def _piecewise(self) -> PiecewiseLayers:
        cuda = self.device.device.type == "cuda"
        log.info("decoder layers run as CUDA graphs around attention" if cuda else
                 "decoder layers run split around attention (no CUDA: not captured)")
        pieces = PiecewiseLayers(self.model.layers.modules, capture=cuda)
        pieces.capture_all()
        return pieces

    def _step_graphs(self, max_batch_size: int) -> StepGraphs:
        cuda = self.device.device.type == "cuda"
        log.info("each step's decoder layers run as one CUDA graph" if cuda else
                 "each step's decoder layers run padded as one graph would (no CUDA: not captured)")
        pieces = PiecewiseLayers(self.model.layers.modules, capture=False)
        whole = StepGraphs(pieces, self.cache, capture=cuda, max_batch_size=max_batch_size)
        whole.capture_all()
        return whole

    def kv_capacity(self) -> int:
        """For the scheduler's ``kv_capacity``: entries of all slots together."""
        return self.cache.capacity_tokens

    # -- Runner protocol -------------------------------------------------------
    @torch.inference_mode()
    def step(self, batch: SchedulerOutput) -> RunnerOutput:
        plan, failed = self.plan(batch)
        tokens: dict[int, list[int]] = {}
        if plan.segments:
            with sdpa_kernel(_SDPA_BACKENDS):  # see [Note: no cuDNN attention]
                hidden = self._forward(plan)
            if plan.sampled:
                logits = self.model.lm_head(self.model.norm(hidden)).float()  # (S, vocab)
                tokens = self.sampler.sample(logits, plan.sampled)
            self._report()
        return RunnerOutput(tokens, failed)

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)
        self.sampler.free(seq_id)

    def close(self) -> None:
        self.model.close()

    # -- the step ----------------------------------------------------------------
    def plan(self, batch: SchedulerOutput) -> tuple[StepPlan, dict[int, str]]:
        """Packs the batch; sequences with token ids outside the vocabulary fail alone."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[Segment] = []
        sampled: list[tuple[int, SamplingParams]] = []
        rows: list[int] = []
        failed: dict[int, str] = {}
        vocab = self.model.description.vocab_size
        work = [(c.seq_id, c.token_ids, c.start, c.is_last, c.sampling) for c in batch.prefills]
        work += [(d.seq_id, (d.token_id,), d.position, True, d.sampling) for d in batch.decodes]
        for seq_id, tokens, start, samples, params in work:
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                failed[seq_id] = f"token id {bad} is outside the vocabulary (size {vocab})"
                continue
            self.cache.check_span(start, start + len(tokens))
            slot = self.cache.allocate(seq_id) if start == 0 else self.cache.slot(seq_id)
            segments.append(Segment(slot=slot, start=start, length=len(tokens), offset=len(ids)))
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [slot] * len(tokens)
            if samples:
                sampled.append((seq_id, params))
                rows.append(len(ids) - 1)
        plan = StepPlan(tuple(ids), tuple(positions), tuple(slots), tuple(segments), tuple(sampled), tuple(rows))
        return plan, failed

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Hidden states ``(S, hidden)`` of the rows that are sampled."""
        if self._attention_kernel:  # every segment in one launch per layer ([Note: slot attention kernel])
            block_m = 1 if all(seg.length == 1 for seg in plan.segments) else ATTENTION_BLOCK_M
            work_items = attention_work(((seg.slot, seg.start, seg.offset, seg.length) for seg in plan.segments),
                                        block_m)
            if self._whole is not None and self._whole.fits(len(plan.token_ids)):
                ids, positions, _, rows, _ = self._inputs(plan, ())
                hidden = self.model.embed(ids)  # (1, N, hidden)
                rotary = self.model.rotary(hidden, positions)
                hidden = self._whole.run(hidden, rotary, slots=plan.slots, positions=plan.positions,
                                         work=work_items, block_m=block_m)
                return hidden[0].index_select(0, rows)  # (S, hidden)
            ids, positions, slots, rows, work = self._inputs(plan, (), extra=work_items)
            chunks, decode, masks = (), None, ()
        else:
            chunks = tuple(seg for seg in plan.segments if seg.length > 1)  # attended one at a time
            decodes = tuple(seg for seg in plan.segments if seg.length == 1)  # attended together
            ids, positions, slots, rows, decode_values = self._inputs(plan, decodes)
            decode = DecodeBatch.build(decodes, decode_values) if decodes else None
            masks = tuple(chunk_mask(seg, self.device.device) for seg in chunks)  # once per step, not per layer
            work, block_m = None, 1
        hidden = self.model.embed(ids)  # (1, N, hidden)
        rotary = self.model.rotary(hidden, positions)  # cos, sin: (1, N, head_dim) each
        token_positions = positions[0]  # (N,)

        def attention(i: int) -> LayerAttention:
            return LayerAttention(self.cache, i, chunks, slots, token_positions, decode, masks, work, block_m)

        if self._pieces is not None and self._pieces.fits(len(plan.token_ids)):
            hidden = self._pieces.run(hidden, rotary, attention)
            return hidden[0].index_select(0, rows)  # (S, hidden)
        layers = self.model.layers
        for i in range(len(layers)):
            layer = layers.acquire(i)
            try:
                out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary,
                            zspeed=attention(i))
                hidden = out[0] if isinstance(out, tuple) else out  # transformers < 5 returns a tuple
            finally:
                layers.release(i)
        return hidden[0].index_select(0, rows)  # (S, hidden)

    def _inputs(self, plan: StepPlan, decodes: tuple[Segment, ...], extra: Sequence[int] = ()
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids ``(1, N)``, positions ``(1, N)``, cache slots ``(N,)``, sampled rows ``(S,)`` and
        :meth:`DecodeBatch.host_values` of the one-token ``decodes`` ``(3B,)`` followed by ``extra``, on the
        device.

        One non-blocking copy from pinned memory: ``torch.tensor(..., device=cuda)``
        would synchronise the stream, once per tensor, and the sampled rows'
        sync would hold the output head back until every layer had run.
        """
        n, s = len(plan.token_ids), len(plan.sample_rows)
        values = torch.tensor([*plan.token_ids, *plan.positions, *plan.slots, *plan.sample_rows,
                               *DecodeBatch.host_values(decodes), *extra], dtype=torch.long)
        host = self.device.pinned_empty(values.shape, dtype=torch.long).copy_(values)
        inputs = host.to(self.device.device, non_blocking=True)
        return (inputs[:n][None], inputs[n:2 * n][None], inputs[2 * n:3 * n], inputs[3 * n:3 * n + s],
                inputs[3 * n + s:])

    def _report(self) -> None:
        if self._observer is None:
            return
        num_bytes, stall = self.model.layers.take_stream_stats()
        if num_bytes or stall:
            self._observer.on_weights_streamed(num_bytes, stall)
        self._observer.set_device_memory(self.device.memory_allocated(), kind="allocated")
