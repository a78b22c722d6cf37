"""The peer of ``bench_serve.py zero-inference``: Hugging Face generate under DeepSpeed ZeRO-Inference.

ZeRO-Inference is ZeRO-3 with parameters offloaded to (pinned) CPU memory and no
optimizer: ``deepspeed.initialize(model=..., config={zero_optimization: {stage: 3,
offload_param: {device: cpu, pin_memory: true}}, bf16...})``, then HF ``generate``
on ``engine.module``, as in DeepSpeedExamples' ``inference/huggingface/zero_inference/
run_model.py`` (``deepspeed.init_inference`` is a different thing: kernel injection,
weights on the GPU). One process, no ``deepspeed`` launcher: the launcher's
environment is set here and torch.distributed initialised with one rank.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

import torch

from zspeed.core.device import DeviceHandle


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(dev: DeviceHandle) -> None:
    """torch.distributed with one rank, as the ``deepspeed`` launcher would set it up."""
    import torch.distributed as dist

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    dev.set_current()
    if not dist.is_initialized():
        dist.init_process_group(dev.backend, rank=0, world_size=1)


def zero_inference_config(hf_config, *, prefetch_elems: int) -> dict:
    """ZeRO-3, parameters offloaded to pinned CPU memory, no optimizer. Parameters under ``hidden_size``
    elements (the norms) stay on the GPU, as in DeepSpeedExamples' zero_inference/run_model.py."""
    return {"bf16": {"enabled": True}, "fp16": {"enabled": False},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "stage3_prefetch_bucket_size": prefetch_elems,
                                  "stage3_param_persistence_threshold": hf_config.hidden_size},
            "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def zero_inference_model(path: Path, dev: DeviceHandle, *, prefetch_elems: int):
    """The HF model of checkpoint ``path`` under ``deepspeed.initialize``; returns (model, ds config, keep):
    ``keep`` (HF's DeepSpeed config) must stay alive while the model is used."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    init_single_process(dev)
    deepspeed.init_distributed(dist_backend=dev.backend)
    ds_config = zero_inference_config(AutoConfig.from_pretrained(path), prefetch_elems=prefetch_elems)
    keep = HfDeepSpeedConfig(ds_config)  # from_pretrained then builds the model under zero.Init (partitioned)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, config=ds_config)[0]
    engine.module.eval()
    return engine.module, ds_config, keep


class ForwardTimer:
    """Host times of each forward of ``model`` (synchronised): the first of a generate is its prefill."""

    def __init__(self, model, dev: DeviceHandle) -> None:
        self.dev, self.calls = dev, []
        model.register_forward_pre_hook(lambda *_: self._mark())
        model.register_forward_hook(lambda *_: self._close())

    def _mark(self) -> None:
        self.dev.synchronize()
        self.calls.append([time.perf_counter(), None])

    def _close(self) -> None:
        self.dev.synchronize()
        self.calls[-1][1] = time.perf_counter()

    def phases(self, start: float, batch: int) -> dict:
        """The same fields as bench_serve's ``phases`` for the runner: decode = end of prefill to end of last."""
        (p0, p1), rest = self.calls[0], self.calls[1:]
        row = {"ttft_s": p1 - start, "prefill_s": p1 - p0, "prefill_steps": 1, "decode_steps": len(rest)}
        if rest:
            span = rest[-1][1] - p1
            row.update(decode_step_s=span / len(rest), decode_tokens_per_s=batch * len(rest) / span,
                       decode_step_runner_median_s=statistics.median(b - a for a, b in rest))
        return row


def hf_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, synced_gpus=False)
