"""Resident decoder layers run as captured CUDA graphs around eager attention (SDPA; with the Triton slot
attention a whole step is one graph instead: [Note: whole-step graphs] in step_graphs.py, which reuses the
layer halves and bucket buffers defined here).

[Note: piecewise graphs] A serving step is host-bound on a GPU: a Llama layer
launches ~50 kernels, and measured on an H100 (session 4, Llama-8B shape,
batch 16) the host took 0.87 ms per layer where the GPU needed 0.39 ms; worse,
the host's speed on these virtual machines drifts (the same decode step took
28 ms for seconds, then 52 ms), which put the drift into the inter-token
gaps. Each layer here is two CUDA graphs: *pre* (input norm, q/k/v
projections, rotary embedding) and *post* (output projection, residual, post
norm, MLP, residual), replayed around the eager attention, which keeps its
per-sequence logic ([Note: packed batch]) and so is never captured. A step's
``N`` tokens are padded to a bucket size ``n`` (graphs are per shape); the
padded rows start from zeros each step, run through the same per-row
operations, and are never attended to or read. The graphs of a bucket are
captured when the runner is built (:meth:`PiecewiseLayers.capture_all`: a
capture in the middle of serving took 60-280 ms, a gap every running request
would see), each after one eager warm-up pass, which also tunes any Triton
kernel of a quantized layer, all in one memory pool:
they replay one after another on one stream, so their scratch memory is
shared. Steps larger than the largest bucket run the eager layers (a prefill
that large is not host-bound).

The layer's own modules do the math, in the order of Hugging Face's
``LlamaDecoderLayer`` / ``LlamaAttention`` forward (Mistral and Qwen2 share
it); architectures whose layer differs (e.g. q/k norms) are not split.
Without CUDA the same split runs eagerly (:attr:`PiecewiseLayers.capture`
False), which is how CPU tests check it against the plain layers.
"""
from __future__ import annotations

import bisect
import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .attention import LayerAttention, slot_attention

log = logging.getLogger("zspeed.serve")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
_SPLIT_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})


def splittable(layer: nn.Module) -> bool:
    """Whether ``layer`` computes exactly what :func:`_pre` and :func:`_post` do."""
    attn = getattr(layer, "self_attn", None)
    return (type(layer).__name__ in _SPLIT_LAYERS and attn is not None
            and all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim"))
            and not hasattr(attn, "q_norm") and _rotary_of(layer) is not None)


def _rotary_of(layer: nn.Module):
    return getattr(sys.modules.get(type(layer).__module__), "apply_rotary_pos_emb", None)


@dataclass(eq=False)
class Buffers:
    """The static tensors of one bucket: every graph of the bucket reads and writes these."""

    hidden: torch.Tensor  # (n, hidden): the layer's input, then its output
    residual: torch.Tensor  # (n, hidden)
    cos: torch.Tensor  # (n, head_dim)
    sin: torch.Tensor
    q: torch.Tensor  # (1, heads, n, head_dim), after the rotary embedding
    k: torch.Tensor  # (1, kv_heads, n, head_dim)
    v: torch.Tensor
    attn_out: torch.Tensor  # (n, heads * head_dim)


class PiecewiseLayers:
    """Runs ``layers`` (resident, all of one splittable kind) as pre/post graphs around attention."""

    def __init__(self, layers: Sequence[nn.Module], *, capture: bool, max_tokens: int = BUCKETS[-1]) -> None:
        if not layers or not all(splittable(layer) for layer in layers):
            raise ValueError("piecewise graphs need Llama-family decoder layers (LlamaDecoderLayer, "
                             "MistralDecoderLayer, Qwen2DecoderLayer)")
        self.layers = list(layers)
        self.capture = capture
        self.buckets = tuple(b for b in BUCKETS if b <= max_tokens) or (BUCKETS[0],)
        self._rotary = _rotary_of(self.layers[0])
        attn = self.layers[0].self_attn
        norm = next(self.layers[0].input_layernorm.parameters())  # q_proj may be a slice of a fused module: no tensors
        self.device, self._dtype = norm.device, norm.dtype
        self._head_dim = attn.head_dim
        self._heads = attn.q_proj.out_features // attn.head_dim
        self._kv_heads = attn.k_proj.out_features // attn.head_dim
        self._hidden = attn.o_proj.out_features
        self._buffers: dict[int, Buffers] = {}
        self._graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def capture_all(self) -> None:
        """Captures every bucket's graphs now (start-up), so no step pays for a capture."""
        if not self.capture:
            return
        start = time.perf_counter()
        with torch.inference_mode():  # a bar as in StepGraphs.capture_all
            for n in tqdm(self.buckets, desc="CUDA graphs", unit="bucket", disable=None):
                if n not in self._graphs:
                    self._capture(self.bucket_buffers(n))
        log.info("piecewise graphs: %d buckets of up to %d tokens captured in %.1fs", len(self.buckets),
                 self.buckets[-1], time.perf_counter() - start)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def run(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
            attention: Callable[[int], LayerAttention]) -> torch.Tensor:
        """``hidden`` ``(1, N, hidden)`` through every layer; ``rotary`` cos/sin ``(1, N, head_dim)``;
        ``attention(i)`` the :class:`LayerAttention` of layer i. Returns ``(1, N, hidden)`` (a view of the
        bucket's buffer, valid until the next call)."""
        n_real = hidden.shape[1]
        bufs = self.load_inputs(hidden, rotary)
        graphs = self._graphs.get(bufs.hidden.shape[0]) if self.capture else None
        if self.capture and graphs is None:
            graphs = self._capture(bufs)
        for i, layer in enumerate(self.layers):
            if graphs is not None:
                graphs[i][0].replay()
            else:
                self.pre(layer, bufs)
            attn = layer.self_attn
            out, _ = slot_attention(attn, bufs.q[:, :, :n_real], bufs.k[:, :, :n_real], bufs.v[:, :, :n_real],
                                    None, scaling=attn.scaling, zspeed=attention(i),
                                    sliding_window=getattr(attn, "sliding_window", None))
            bufs.attn_out[:n_real].copy_(out.reshape(n_real, -1))
            if graphs is not None:
                graphs[i][1].replay()
            else:
                self.post(layer, bufs)
        return bufs.hidden[:n_real][None]

    def load_inputs(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> Buffers:
        """The buffers of ``hidden``'s bucket, holding ``hidden`` ``(1, N, hidden)`` and ``rotary`` in their first
        ``N`` rows and zeros in the hidden rows past them."""
        n_real = hidden.shape[1]
        bufs = self.bucket_buffers(self.bucket(n_real))
        bufs.hidden[:n_real].copy_(hidden[0])
        bufs.hidden[n_real:].zero_()
        bufs.cos[:n_real].copy_(rotary[0][0])
        bufs.sin[:n_real].copy_(rotary[1][0])
        return bufs

    # -- the two halves of a layer ---------------------------------------------------
    def pre(self, layer: nn.Module, bufs: Buffers) -> None:
        attn = layer.self_attn
        n = bufs.hidden.shape[0]
        bufs.residual.copy_(bufs.hidden)
        h = layer.input_layernorm(bufs.hidden)
        q = attn.q_proj(h).view(1, n, -1, self._head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, n, -1, self._head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(1, n, -1, self._head_dim).transpose(1, 2)
        q, k = self._rotary(q, k, bufs.cos[None], bufs.sin[None])
        bufs.q.copy_(q)
        bufs.k.copy_(k)
        bufs.v.copy_(v)

    @staticmethod
    def post(layer: nn.Module, bufs: Buffers) -> None:
        h = bufs.residual + layer.self_attn.o_proj(bufs.attn_out)
        bufs.hidden.copy_(h + layer.mlp(layer.post_attention_layernorm(h)))

    # -- buffers and capture ---------------------------------------------------------
    def bucket_buffers(self, n: int) -> Buffers:
        bufs = self._buffers.get(n)
        if bufs is None:
            def zeros(*shape: int) -> torch.Tensor:
                return torch.zeros(shape, device=self.device, dtype=self._dtype)

            d = self._head_dim
            bufs = self._buffers[n] = Buffers(
                hidden=zeros(n, self._hidden), residual=zeros(n, self._hidden), cos=zeros(n, d), sin=zeros(n, d),
                q=zeros(1, self._heads, n, d), k=zeros(1, self._kv_heads, n, d), v=zeros(1, self._kv_heads, n, d),
                attn_out=zeros(n, self._heads * d))
        return bufs

    def _capture(self, bufs: Buffers) -> list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]]:
        n = bufs.hidden.shape[0]
        start = time.perf_counter()
        saved = {name: getattr(bufs, name).clone() for name in ("hidden", "cos", "sin")}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: library handles, workspaces, Triton tuning, outside any capture
            for layer in self.layers:
                self.pre(layer, bufs)
                self.post(layer, bufs)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for layer in self.layers:
            pre, post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre, pool=self._pool):
                self.pre(layer, bufs)
            with torch.cuda.graph(post, pool=self._pool):
                self.post(layer, bufs)
            graphs.append((pre, post))
        for name, value in saved.items():  # the warm-up overwrote this step's inputs
            getattr(bufs, name).copy_(value)
        self._graphs[n] = graphs
        log.debug("captured %d graphs for steps of up to %d tokens in %.2fs", 2 * len(graphs), n,
                 time.perf_counter() - start)
        return graphs
