"""zspeed.kernels: Triton matmuls over compressed weights, each with a plain-PyTorch reference.

=====================  ==========================  ===========================
custom op              launcher (Triton)           reference
=====================  ==========================  ===========================
``zspeed::w8a16_mm``   :func:`w8a16_matmul`        :func:`w8a16_ref`
``zspeed::w4a16_mm``   :func:`w4a16_matmul`        :func:`w4a16_ref`
``zspeed::sparse24_mm``  :func:`sparse24_matmul`   :func:`sparse24_ref`
``zspeed::sparse24_w4a16_mm``  :func:`sparse24_w4a16_matmul`  :func:`sparse24_w4a16_ref`
=====================  ==========================  ===========================

Serving's attention over the slot KV cache is one Triton kernel too
(:func:`slot_attention`, reference :func:`slot_attention_ref`; [Note: slot
attention kernel]); it is called directly, not through a custom op.

The custom ops run Triton on CUDA tensors and the reference on any other device,
and have fake implementations, so ``torch.compile`` traces through them. Which
Triton path runs (split-K, tiled, dequantize + cuBLAS) is set by
:class:`KernelPolicy` (see ``dispatch``).
"""
from ._runtime import HAS_TRITON, interpreting
from .attention import attention_work, slot_attention, slot_attention_ref
from .dispatch import KernelPolicy, kernel_policy, set_kernel_policy
from .sparse24 import sparse24_matmul, sparse24_mm, sparse24_ref
from .sparse24_w4a16 import sparse24_w4a16_matmul, sparse24_w4a16_mm, sparse24_w4a16_ref
from .w4a16 import w4a16_matmul, w4a16_mm, w4a16_ref
from .w8a16 import w8a16_matmul, w8a16_mm, w8a16_ref

__all__ = [
    "HAS_TRITON", "interpreting", "KernelPolicy", "kernel_policy", "set_kernel_policy",
    "w8a16_matmul", "w8a16_mm", "w8a16_ref", "w4a16_matmul", "w4a16_mm", "w4a16_ref",
    "sparse24_matmul", "sparse24_mm", "sparse24_ref",
    "sparse24_w4a16_matmul", "sparse24_w4a16_mm", "sparse24_w4a16_ref",
    "attention_work", "slot_attention", "slot_attention_ref",
]
