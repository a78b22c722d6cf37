"""A small PTX emulator for the inline asm of the Gluon GEMV kernels, which the CPU interpreter cannot run: the
instructions their asm uses, lane by lane, and ``mma.sync.m16n8k16`` across 32 lanes as the PTX ISA lays out its
fragments (tests/test_kernels_dense_mma.py, tests/test_kernels_stripe_wgmma.py)."""
from __future__ import annotations

import re

import torch


def bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


def pair(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return bf16_bits(lo) | (bf16_bits(hi) << 16)


def unpair(reg: int) -> tuple[float, float]:
    both = torch.tensor([reg & 0xFFFF, (reg >> 16) & 0xFFFF], dtype=torch.int32).to(torch.int16)
    lo, hi = both.view(torch.bfloat16).float().tolist()
    return lo, hi


def emulate(asm: str, operands: list[list[int | float]]) -> list[list[float]]:
    """Run the inline asm on 32 lanes: ``operands[lane][i]`` is ``$i`` (outputs first, ignored on input); the
    instructions the stripe's asm uses, ``mma.sync.m16n8k16`` across the lanes as the PTX ISA lays out its fragments."""
    regs = [dict() for _ in range(32)]

    def val(lane: int, name: str):
        if name.startswith("$"):
            return operands[lane][int(name[1:])]
        if name.startswith("0f"):
            return 0.0
        if name.startswith("0x") or name.isdigit():
            return int(name, 0)
        return regs[lane][name]

    outputs = [[0.0] * 8 for _ in range(32)]
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op.startswith("mma.sync"):
            groups = [g.split(", ") for g in re.findall(r"\{([^}]*)\}", rest)]
            d, a, b, c = groups
            A, B, C = torch.zeros(16, 16), torch.zeros(16, 8), torch.zeros(16, 8)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                a_vals = [unpair(val(lane, r)) for r in a]
                for (row, col), (lo, hi) in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)),
                                                a_vals):
                    A[row, col], A[row, col + 1] = lo, hi
                for i, r in enumerate(b):
                    B[2 * t + 8 * i, g], B[2 * t + 8 * i + 1, g] = unpair(val(lane, r))
                for i, r in enumerate(c):
                    C[g + 8 * (i // 2), 2 * t + i % 2] = val(lane, r)
            D = A @ B + C
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i, r in enumerate(d):
                    regs[lane][r] = D[g + 8 * (i // 2), 2 * t + i % 2].item()
            continue
        args = rest.split(", ")
        for lane in range(32):
            v = [val(lane, x) for x in args[1:]]
            if op in ("mov.b32", "mov.f32"):
                out = v[0]
            elif op == "shr.u32":
                out = (v[0] & 0xFFFFFFFF) >> v[1]
            elif op == "lop3.b32":
                lut, out = v[3], 0
                for bit in range(32):
                    idx = (((v[0] >> bit) & 1) << 2) | (((v[1] >> bit) & 1) << 1) | ((v[2] >> bit) & 1)
                    out |= ((lut >> idx) & 1) << bit
            elif op == "add.f32":
                out = v[0] + v[1]
            elif op == "fma.rn.bf16x2":
                (a0, a1), (b0, b1), (c0, c1) = (unpair(x) for x in v)
                out = int(pair(torch.tensor(a0 * b0 + c0), torch.tensor(a1 * b1 + c1)))
            elif op == "prmt.b32":  # default mode: byte i of the result is byte (selector nibble i) of {v1, v0}
                both = (v[0] & 0xFFFFFFFF) | ((v[1] & 0xFFFFFFFF) << 32)
                out = sum(((both >> (8 * ((v[2] >> (4 * i)) & 0x7))) & 0xFF) << (8 * i) for i in range(4))
            elif op == "mul.rn.bf16x2":  # the exact product, rounded once to bf16
                (a0, a1), (b0, b1) = (unpair(x) for x in v)
                out = int(pair(torch.tensor(a0 * b0), torch.tensor(a1 * b1)))  # (exact in fp32 first)
            else:
                raise AssertionError(f"the emulator does not know {op}")
            if args[0].startswith("$"):
                outputs[lane][int(args[0][1:])] = out
            else:
                regs[lane][args[0]] = out
    return outputs
