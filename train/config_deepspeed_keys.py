"""DeepSpeed config keys that zspeed knows but does not implement, and key aliases.

[Note: unsupported keys are errors, never ignored]
A DeepSpeed config that asks for something zspeed does not do must fail loudly:
silently dropping e.g. ``pipeline`` or ``zero_quantized_weights`` would train a
different model, or a slower one, than the user believes. Two cases are not a
request and are accepted:

* a *switchable section* (``flops_profiler``, ``tensorboard``, ``elasticity``, ...)
  whose ``enabled`` is false or absent: the user asked for the feature to be off,
  and it is off;
* a *tuning key* set to DeepSpeed's own default (``"round_robin_gradients": false``,
  ``"sub_group_size": 1e9``): it asks for DeepSpeed's default behaviour, which
  changes nothing.

Anything else in this catalogue is a :class:`ConfigError` that says it is a
DeepSpeed option zspeed does not support, and what it would have done.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_ANY = object()  # sentinel: there is no harmless value; any presence is an error


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A DeepSpeed key zspeed does not implement. ``what`` says what it does in DeepSpeed."""

    what: str
    default: Any = _ANY
    switchable: bool = False  # a section that is harmless while its "enabled" is false

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` requests nothing beyond what zspeed does (see the module note)."""
        if self.switchable:
            return value is None or (isinstance(value, dict) and not _truthy(value.get("enabled", False)))
        if self.default is _ANY:
            return False
        return _same_as_default(value, self.default)

    def remedy(self) -> str:
        if self.switchable:
            return "remove the section or set its \"enabled\" to false"
        if self.default is _ANY:
            return "remove it from the config"
        return f"remove it or set it to DeepSpeed's default ({_json_repr(self.default)})"


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("false", "0", "")
    return bool(v)


def _same_as_default(value: Any, default: Any) -> bool:
    if default is None or isinstance(default, bool):
        if isinstance(value, str) and isinstance(default, bool):
            return value.strip().lower() == str(default).lower()
        return value is default
    if isinstance(default, (int, float)):
        if isinstance(value, bool):
            return False
        try:
            v = float(value)
        except (TypeError, ValueError):
            return False
        return math.isclose(v, float(default), rel_tol=1e-12)
    return value == default


def _json_repr(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _off(what: str) -> Unsupported:
    return Unsupported(what, switchable=True)


def _never(what: str) -> Unsupported:
    return Unsupported(what)


def _dflt(what: str, default: Any) -> Unsupported:
    return Unsupported(what, default)


UNSUPPORTED: dict[str, Unsupported] = {
    # top level: features
    "pipeline": _never("pipeline parallelism"),
    "tensor_parallel": _never("tensor parallelism (AutoTP)"),
    "sparse_attention": _never("block-sparse attention kernels"),
    "compression_training": _never("compression-aware training (quantization and pruning schedules)"),
    "weight_quantization": _never("post-training weight quantization"),
    "quantize_training": _off("quantization-aware training (MoQ)"),
    "checkpoint": _never("checkpoint tag validation, universal checkpoints, node-local storage"),
    "data_types": _never("a separate dtype for gradient accumulation"),
    "compile": _never("deepspeed.compile / DeepCompile"),
    "timers": _never("DeepSpeed's throughput timers"),
    "hybrid_engine": _off("the RLHF hybrid engine"),
    "elasticity": _off("DeepSpeed's elastic batch-size search; zspeed restarts elastically under torchrun"),
    "flops_profiler": _off("the FLOPs profiler"),
    "comms_logger": _off("the communication logger"),
    "tensorboard": _off("TensorBoard monitoring"),
    "wandb": _off("Weights & Biases monitoring"),
    "csv_monitor": _off("CSV monitoring"),
    "comet": _off("Comet monitoring"),
    "autotuning": _off("the autotuner"),
    "curriculum_learning": _off("curriculum learning"),
    "data_efficiency": _off("data-efficiency sampling and routing"),
    "eigenvalue": _off("Hessian eigenvalue computation"),
    "progressive_layer_drop": _off("progressive layer dropping"),
    "amp": _off("NVIDIA Apex AMP"),
    "nebula": _off("Nebula asynchronous checkpointing"),
    "torch_autocast": _off("torch.autocast inside the engine"),
    # top level: tuning keys
    "prescale_gradients": _dflt("scaling gradients before the all-reduce", False),
    "gradient_predivide_factor": _dflt("dividing gradients by a factor before the all-reduce", 1.0),
    "sparse_gradients": _dflt("sparse gradients for embeddings", False),
    "communication_data_type": _dflt("a separate dtype for gradient communication", None),
    "seq_parallel_communication_data_type": _dflt("the dtype of sequence-parallel communication", "fp32"),
    "memory_breakdown": _dflt("DeepSpeed's memory-breakdown printout", False),
    "dump_state": _dflt("printing the engine state after initialisation", False),
    "disable_allgather": _dflt("broadcasts instead of all-gathers after the step", False),
    "zero_force_ds_cpu_optimizer": _dflt("forcing DeepSpeedCPUAdam with CPU offload", True),
    "dataloader_drop_last": _dflt("dropping the last partial batch in DeepSpeed's dataloader", False),
    "sequence_parallel_size": _dflt("sequence parallelism (Ulysses)", 1),
    "graph_harvesting": _dflt("CUDA-graph harvesting", False),
    "use_data_before_expert_parallelism": _dflt("MoE data ordering", False),
    # optimizer
    "optimizer.legacy_fusion": _dflt("DeepSpeed's legacy fused fp16 optimizer", False),
    "optimizer.params.bias_correction": _dflt("turning off Adam's bias correction", True),
    # precision
    "fp16.auto_cast": _dflt("casting inputs to fp16 inside the engine", False),
    "fp16.fp16_master_weights_and_grads": _dflt("fp16 master weights and gradients", False),
    "bf16.immediate_grad_update": _dflt("applying bf16 gradients to master weights during backward", False),
    "bf16.check_grad_overflow": _dflt("checking bf16 gradients for overflow", False),
    "bf16.bf16_master_weights_and_grads": _dflt("bf16 master weights and gradients", False),
    "bf16.bf16_optimizer_states": _dflt("bf16 optimizer states", False),
    # ZeRO
    "zero_optimization.sub_group_size": _dflt("stepping the optimizer in sub-groups of this many elements",
                                              1_000_000_000),
    "zero_optimization.round_robin_gradients": _dflt("round-robin gradient partition ordering", False),
    "zero_optimization.elastic_checkpoint": _dflt("DeepSpeed's elastic checkpoint format", False),
    "zero_optimization.load_from_fp32_weights": _dflt("loading from 16-bit instead of fp32 weights", True),
    "zero_optimization.ignore_unused_parameters": _dflt("failing on parameters without gradients", True),
    "zero_optimization.legacy_stage1": _dflt("the legacy stage-1 implementation", False),
    "zero_optimization.cpu_offload": _dflt(
        "the deprecated optimizer offload switch (use offload_optimizer.device = 'cpu')", False),
    "zero_optimization.cpu_offload_param": _dflt(
        "the deprecated parameter offload switch (use offload_param.device = 'cpu')", False),
    "zero_optimization.cpu_offload_use_pin_memory": _dflt(
        "the deprecated pinned-memory switch (use offload_*.pin_memory)", False),
    "zero_optimization.stage3_model_persistence_threshold": _dflt(
        "a cap on the total size of persistent parameters", 9223372036854775807),
    "zero_optimization.zero_hpz_partition_size": _dflt("ZeRO++ hierarchical (secondary) partitioning", 1),
    "zero_optimization.zero_quantized_weights": _dflt("ZeRO++ quantized weight all-gather", False),
    "zero_optimization.zero_quantized_nontrainable_weights": _dflt(
        "ZeRO++ quantized non-trainable weights", False),
    "zero_optimization.zero_quantized_gradients": _dflt("ZeRO++ quantized gradient reduce-scatter", False),
    "zero_optimization.zeropp_loco_param": _dflt("ZeRO++ LoCo error feedback", None),
    "zero_optimization.mics_shard_size": _dflt("MiCS sub-group sharding", -1),
    "zero_optimization.mics_hierarchical_params_gather": _dflt("MiCS hierarchical all-gather", False),
    "zero_optimization.memory_efficient_linear": _dflt("DeepSpeed's memory-efficient linear autograd", True),
    "zero_optimization.pipeline_loading_checkpoint": _dflt("loading checkpoints through the pipeline", False),
    "zero_optimization.override_module_apply": _dflt("patching Module.apply under ZeRO-3", True),
    "zero_optimization.log_trace_cache_warnings": _dflt("trace-cache warnings", False),
    "zero_optimization.use_all_reduce_for_fetch_params": _dflt("all-reduce instead of all-gather for fetches",
                                                               False),
    "zero_optimization.stage3_module_granularity_threshold": _dflt("leaf-module fetch granularity", 0),
    "zero_optimization.module_granularity_threshold": _dflt("leaf-module fetch granularity", 0),
    "zero_optimization.use_multi_rank_bucket_allreduce": _dflt("multi-rank bucket all-reduce", True),
    "zero_optimization.offload_optimizer.pipeline": _dflt("pipelined NVMe optimizer swapping", False),
    "zero_optimization.offload_optimizer.pipeline_read": _dflt("pipelined NVMe optimizer reads", False),
    "zero_optimization.offload_optimizer.pipeline_write": _dflt("pipelined NVMe optimizer writes", False),
    "zero_optimization.offload_optimizer.fast_init": _dflt("fast NVMe optimizer initialisation", False),
}

# Other spellings DeepSpeed accepts for a key -> the key zspeed's schema uses.
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}

# DeepSpeed optimizer / scheduler types zspeed does not build.
UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "lamb": "Lamb", "onebitadam": "OneBitAdam", "onebitlamb": "OneBitLamb", "zerooneadam": "ZeroOneAdam",
    "adagrad": "Adagrad", "lion": "Lion", "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD",
    "muon": "Muon", "adam8bit": "Adam8bit (use AdamW8bit)",
}
UNSUPPORTED_SCHEDULERS: dict[str, str] = {"lrrangetest": "LRRangeTest", "onecycle": "OneCycle"}
