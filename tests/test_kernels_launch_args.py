"""The tuner's configs reach the GPU launchers through ``_word.run_dense_mma`` and ``_word.run_sparse_mma``, which only
a GPU runs. Here each kind of config goes through them on the CPU to a stand-in for its launcher that checks the
call against the launcher's signature: a keyword one launcher lacks (the kind of slip a GPU run finds first) fails
here."""
from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from zspeed.kernels import _dense_mma, _sparse_mma, _word


class Called(Exception):
    """Raised by a stand-in launcher once the call bound to the real launcher's signature."""


@pytest.fixture
def launchers(monkeypatch):
    for module, names in ((_dense_mma, ("run_dense_mma_w4", "run_dense_mma_w4_fold")),
                          (_sparse_mma, ("run_sparse_mma", "run_sparse_mma_w4", "run_sparse_mma_fold",
                                         "run_sparse_mma_w4_fold", "run_sparse_mma_stripe", "run_sparse_gemm",
                                         "run_sparse_gemm_w4"))):
        for name in names:
            real = getattr(module, name)

            def stand_in(*args, real=real, name=name, **kwargs):
                inspect.signature(real).bind(*args, **kwargs)  # TypeError on a keyword the launcher lacks
                raise Called(name)

            monkeypatch.setattr(module, name, stand_in)


DENSE = {"run_dense_mma_w4": _word.WordConfig(1, 64, 64, 1, 4, row_blocks=1, dense_mma=True),
         "run_dense_mma_w4_fold": _word.WordConfig(1, 32, 64, 1, 4, row_blocks=1, dense_mma=True, fold=True)}
SPARSE = {"run_sparse_mma": _word.WordConfig(1, 64, 32, 1, 4, row_blocks=1, sparse_mma=True),
          "run_sparse_mma_stripe": _word.WordConfig(1, 64, 32, 1, 4, row_blocks=1, sparse_mma=True, stripe=2),
          "run_sparse_mma_fold": _word.WordConfig(1, 32, 32, 1, 4, row_blocks=1, sparse_mma=True, fold=True),
          "run_sparse_gemm": _word.WordConfig(16, 64, 32, 1, 4, sparse_mma=True)}
SPARSE_W4 = {"run_sparse_mma_w4": _word.WordConfig(1, 64, 32, 1, 4, row_blocks=1, sparse_mma=True),
             "run_sparse_mma_w4_fold": _word.WordConfig(1, 32, 32, 1, 4, row_blocks=1, sparse_mma=True, fold=True),
             "run_sparse_gemm_w4": _word.WordConfig(16, 64, 32, 1, 4, sparse_mma=True)}


# warps along K: the INT4 GEMVs on tensor cores and 2:4 + INT4 with folded rows
ALONG_K = ("run_dense_mma_w4", "run_dense_mma_w4_fold", "run_sparse_mma_w4_fold")


@pytest.mark.parametrize("kind,k_warps", [(kind, 1) for kind in (*DENSE, *SPARSE, *SPARSE_W4)]
                         + [(kind, 4) for kind in ALONG_K])
def test_each_kind_of_config_reaches_its_launcher_with_arguments_it_takes(launchers, kind, k_warps):
    c = {**DENSE, **SPARSE, **SPARSE_W4}[kind]
    if k_warps > 1:
        c = replace(c, k_warps=k_warps, warps=8, block_w=4 * c.block_w, late_sums=2 if c.fold else 0)
    x = torch.zeros(c.block_m, 512, dtype=torch.bfloat16)
    words, meta = torch.zeros(64, 64, dtype=torch.int32), torch.zeros(64, 64, dtype=torch.uint8)
    s, z = torch.ones(64, 4, dtype=torch.bfloat16), torch.zeros(64, 4, dtype=torch.uint8)
    with pytest.raises(Called, match=f"^{kind}$"):
        if kind in DENSE:
            _word.run_dense_mma(x, words, s, z, c, n=64, group=128)
        elif kind in SPARSE:
            _word.run_sparse_mma(x, words, meta, c, n=64)
        else:
            _word.run_sparse_mma(x, words, meta, c, n=64, s=s, z=z, group=128)
