"""What the GEMV tests share: the tuner's candidate lists, recorded, and the Gluon GEMV kernels compiled for sm_90 on the
CPU (``tests/sm90_compile.py`` runs the compile script)."""
from __future__ import annotations

import json
import types
from pathlib import Path

from tests.sm90_compile import run_compile_script
from zspeed.kernels import _word


class Picked(Exception):
    """Raised by the tuner stand-in of :func:`record_offers` once it has the candidates."""


def record_offers(monkeypatch, module, possible: str) -> list:
    """The candidate lists that ``_word.run_gemv`` hands its tuner (which raises :class:`Picked`), on a stand-in H100
    where ``module.possible`` says the kernel runs."""
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    monkeypatch.setattr(module, possible, lambda device: True)
    lists = []

    def pick(key, candidates, launch):
        lists.append(candidates)
        raise Picked

    monkeypatch.setattr(_word, "_pick", pick)
    return lists


def record_launch_kwarg(monkeypatch, module, key: str, kernels: tuple[str, ...], asms: tuple[str, ...]) -> list:
    """Stand in for ``module._kernels()``: a launch of any of ``kernels`` runs nothing and appends the value of its
    keyword argument ``key`` to the list returned; the asm builders ``asms`` return empty asm."""
    asked = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: asked.append(kwargs[key])

    stub = types.SimpleNamespace(**{name: Kernel() for name in kernels}, **{name: lambda *a: ("", "") for name in asms})
    monkeypatch.setattr(module, "_kernels", lambda: stub)
    return asked


# argv: kernel name, constexprs (JSON), the cubin's path. Prints the JSON of the SASS's (opcode, operands), stack,
# local memory and registers.
_COMPILE = r'''
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from zspeed.kernels import _dense_mma_kernels, _sparse_gemm_kernels, _sparse_mma_kernels, _stripe_wgmma_kernels

kernel_name, const = sys.argv[1], json.loads(sys.argv[2])
fn = getattr(_sparse_gemm_kernels if kernel_name.startswith("sparse_gemm") else _dense_mma_kernels
             if kernel_name.startswith("dense") else _stripe_wgmma_kernels if kernel_name.startswith("stripe_wgmma")
             else _sparse_mma_kernels, kernel_name)
w4 = kernel_name.endswith("w4_kernel") or const.get("W4", False)  # 2:4 + INT4: codes read as int16, scales, zeros
w_dtype = torch.int16 if w4 else torch.int32
x_dtype = torch.int32
if kernel_name == "sparse_mma_w4_kernel":  # the GEMV: a lane's codes of a stripe in one load, the stripe's asm
    const["ASM"], const["ASM_IO"] = _sparse_mma_kernels.w4_stripe_asm(const["STRIPE"])
    const.setdefault("XVEC", True)  # x 16 bytes a tile
    w_dtype = torch.int64 if const["STRIPE"] == 4 else torch.int32
if kernel_name == "sparse_mma_stripe_kernel":  # plain 2:4 in stripes: a lane's two value words a tile, the asm
    const["ASM"], const["ASM_IO"] = _sparse_mma_kernels.s24_stripe_asm(const["STRIPE"])
    w_dtype = torch.int64
m_dtype = torch.int32
if kernel_name == "sparse_mma_fold_kernel":  # plain 2:4, folded rows: 64-bit halves of quads, an MMA's positions
    const["ASM"], const["ASM_IO"] = _sparse_mma_kernels.s24_fold_asm()
    w_dtype, m_dtype = torch.int64, torch.int64
if kernel_name == "sparse_mma_w4_fold_kernel":  # 2:4 + INT4, folded rows: a lane's 8 code bytes of a pair, the asm
    const["ASM"], const["ASM_IO"] = _sparse_mma_kernels.w4_fold_asm()
    const.setdefault("WK", 1)
    w_dtype = torch.int64
if kernel_name == "dense_mma_w4_kernel":  # INT4 words, x gathered as int16, the stripe's asm
    const["ASM"], const["ASM_IO"] = _dense_mma_kernels.w4_dense_asm(const["NT"])
    const.setdefault("XVEC", True)  # x a word at a time
    w_dtype, x_dtype = torch.int32, torch.int16  # (words: K / 8 a row, as 2:4 + INT4's codes)
if kernel_name == "dense_mma_w4_fold_kernel":  # the same with folded rows
    const["ASM"], const["ASM_IO"] = _dense_mma_kernels.w4_dense_fold_asm()
    const.setdefault("WK", 1)
    const.setdefault("LATE", False)
    const.setdefault("XVEC", True)  # x a word at a time
    w_dtype, x_dtype = torch.int32, torch.int16
if kernel_name == "stripe_wgmma_w4_kernel":  # INT4 words, bf16 x and scales, the asm and the codes' layout
    const["ASM"], const["ASM_IO"] = _stripe_wgmma_kernels.stripe_wgmma_asm()
    const.setdefault("MN", 16)
    const["CL"] = _stripe_wgmma_kernels.stripe_layout(const["num_warps"], const["QI"])  # (a layout: not JSON)
    w_dtype, x_dtype = torch.int32, torch.bfloat16
n, k = 8192, 8192
values = dict(x_ptr=torch.empty(1, dtype=x_dtype), w_ptr=torch.empty(1, dtype=w_dtype),
              meta_ptr=torch.empty(1, dtype=m_dtype), s_ptr=torch.empty(1, dtype=torch.bfloat16),
              z_ptr=torch.empty(1, dtype=torch.uint8), part_ptr=torch.empty(1, dtype=torch.float32),
              count_ptr=torch.empty(1, dtype=torch.int32), out_ptr=torch.empty(1, dtype=torch.bfloat16),
              M=1, N=n, TILES=k // 32, MMAS=k // 64, PAIRS=k // 128, STRIPES=k // 128, SPLIT=4, CHUNKS=8, RUNS=n // 64,
              stride_xm=k if x_dtype in (torch.int16, torch.bfloat16) else k // 2, stride_wn=k // 8 if w4 else k // 4,
              stride_mn=k // 32, stride_sn=k // 128, stride_zn=k // 128, stride_om=n)
names = [a for a in fn.arg_names if a not in const]
sig = {a: mangle_type(values[a]) for a in names}
sig.update({a: "constexpr" for a in const})
# pointers and strides as the JIT specializes them at a real launch (multiples of 16)
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in names
         if a.endswith("_ptr") or a.startswith("stride") or a == "N"}
kernel = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": const["num_warps"]})
path = sys.argv[3]
open(path, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
found = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass, flags=re.M)
ops = [(op, rest) for _, op, rest in found]
print(json.dumps({"ops": ops, "addrs": [int(addr, 16) for addr, _, _ in found],
                  "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
                  "local": int(re.search(r"LOCAL:(\d+)", res).group(1)),
                  "regs": int(re.search(r"REG:(\d+)", res).group(1))}))
'''


def compile_gemv_kernel(tmp_path: Path, kernel: str, const: dict) -> dict:
    """``kernel`` of the sparse or dense MMA kernels compiled for sm_90 with ``const``: ``ops`` ((opcode, operands)
    of its SASS), ``addrs`` (their addresses), ``stack``, ``local`` and ``regs``."""
    return run_compile_script(_COMPILE, [kernel, json.dumps(const), str(tmp_path / f"{kernel}.cubin")], tmp_path)


def loop_around(got: dict, prefix: str) -> list[str]:
    """The opcodes of the loop around the first instruction starting with ``prefix`` in ``compile_gemv_kernel``'s
    ``ops``: from the target of the backward branch that jumps over it to that branch; where ptxas unrolled the loop
    whole (no such branch), from that instruction to the last one starting with ``prefix``."""
    ops, addrs = [op for op, _ in got["ops"]], got["addrs"]
    at = [i for i, op in enumerate(ops) if op.startswith(prefix)]
    start, end = next(((addrs.index(int(rest, 16)), j) for j, (op, rest) in enumerate(got["ops"])
                       if op == "BRA" and int(rest, 16) <= addrs[at[0]] < addrs[j]), (at[0], at[-1]))
    return ops[start:end]
