"""Model-state bytes per rank at ZeRO stages 1-3 against the ZeRO formulas, at any world size.

    torchrun --nproc-per-node 8 benchmarks/memory_scaling.py            # CPU: gloo, a small Llama
    torchrun --nproc-per-node 8 benchmarks/memory_scaling.py --hidden 2048 --layers 22   # GPUs: NCCL

Each rank builds the same Llama-shaped model, wraps it with ``zspeed.initialize`` at each stage (bf16, AdamW),
runs one step and one more backward, and measures what it holds (flat buffers + optimizer state, storages
counted once) while every term of the formula exists: gradients reduced, before the step frees them.
Rank 0 prints held / formula per stage; the formula is core/memory.py's ``zero_memory_per_rank`` with
``separate_param_shard=False`` (zspeed casts the stage-3 16-bit shard from the fp32 master when gathering).
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zspeed
from zspeed.core.memory import format_bytes, tensor_bytes, zero_memory_per_rank
from zspeed.core.topology import Topology


def measure(topo: Topology, args, stage: int) -> tuple[int, int, int]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zspeed.initialize(model=model, config=ds, topology=topo)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(topo.rank))
    ids = ids.to(engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    for g in engine.groups:
        g.wait_reductions()
    held = tensor_bytes(engine.model_state_tensors())
    engine.step()
    n_params = sum(g.numel for g in engine.groups)
    want = zero_memory_per_rank(n_params, stage=stage, world_size=topo.world_size, separate_param_shard=False)
    return held, want.total, n_params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    topo = Topology.from_env()
    rows = [(stage, *measure(topo, args, stage)) for stage in (0, 1, 2, 3)]
    if topo.is_main:
        print(f"world size {topo.world_size}, {rows[0][3] / 1e6:.2f} M parameters, bf16 + AdamW")
        print(f"{'stage':>5s} {'held per rank':>14s} {'formula':>12s} {'held/formula':>13s} {'16Psi/N':>10s}")
        for stage, held, want, n in rows:
            print(f"{stage:5d} {format_bytes(held):>14s} {format_bytes(want):>12s} {held / want:13.4f} "
                  f"{format_bytes(16 * n / topo.world_size):>10s}")
    topo.shutdown()


if __name__ == "__main__":
    main()
