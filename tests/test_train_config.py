"""DeepSpeed JSON → ZSpeedConfig: batch triangle, "auto", unknown and unsupported keys,
invalid values, numbers as strings; and the optimizer factory built from it."""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from zspeed.train.config import AutoContext, ConfigError, config_to_dict, describe_keys, load_config, \
    resize_for_world_size
from zspeed.train.config_schema import (
    OffloadDevice,
    OptimizerType,
    Precision,
    SchedulerType,
    WarmupType,
    ZeroConfig,
    ZSpeedConfig,
)
from zspeed.train.optim_factory import build_optimizer, fused_supported


def load(cfg: dict, world_size: int = 2, **ctx) -> ZSpeedConfig:
    return load_config(cfg, world_size=world_size, auto_context=AutoContext(**ctx))


def error_of(cfg: dict, world_size: int = 2, **ctx) -> str:
    with pytest.raises(ConfigError) as info:
        load(cfg, world_size, **ctx)
    return str(info.value)


# -- the batch-size triangle -----------------------------------------------------------------

@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (24, 4, 3)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, (32, 4, 4)),
    ({"train_batch_size": 16}, (16, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, (10, 5, 1)),
])
def test_batch_triangle_any_two_determine_the_third(given, expected):
    c = load(given, world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected
    assert c.world_size == 2


def test_inconsistent_batch_sizes_show_the_arithmetic():
    msg = error_of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})
    assert "train_batch_size (32) != train_micro_batch_size_per_gpu (4) × gradient_accumulation_steps (3) × " \
           "world_size (2) = 24" in msg


def test_indivisible_batch_shows_the_division():
    msg = error_of({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    assert "30 / 8 = 3.75" in msg and "gradient_accumulation_steps" in msg


def test_missing_batch_size_is_an_error():
    assert "batch size is not determined" in error_of({"gradient_accumulation_steps": 2})


def test_dataclass_checks_the_triangle_itself():
    with pytest.raises(ConfigError, match="= 16"):
        ZSpeedConfig(world_size=2, train_batch_size=10, train_micro_batch_size_per_gpu=4,
                     gradient_accumulation_steps=2)


def test_resize_for_world_size_keeps_global_batch():
    c = load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert resize_for_world_size(c, 4).gradient_accumulation_steps == 2
    assert resize_for_world_size(c, 1).gradient_accumulation_steps == 8
    with pytest.raises(ConfigError, match="32 / 12"):
        resize_for_world_size(c, 3)


# -- "auto" --------------------------------------------------------------------------------------

HF_STYLE = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
HF_CONTEXT = dict(hidden_size=1024, lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, micro_batch_size=4,
                  gradient_accumulation_steps=2, gradient_clipping=1.0, bf16=True, warmup_num_steps=100,
                  total_num_steps=1000)


def test_auto_values_resolve_from_the_context():
    c = load(HF_STYLE, world_size=2, **HF_CONTEXT)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 4, 2)
    assert c.gradient_clipping == 1.0 and c.precision is Precision.BF16
    p = c.optimizer.params
    assert (p.lr, p.betas, p.eps, p.weight_decay) == (3e-4, (0.9, 0.95), 1e-6, 0.1)
    s = c.scheduler.params
    assert (s.warmup_min_lr, s.warmup_max_lr, s.warmup_num_steps, s.total_num_steps) == (0.0, 3e-4, 100, 1000)
    z = c.zero_optimization
    assert z.reduce_bucket_size == 1024 * 1024
    assert z.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert z.stage3_param_persistence_threshold == 10 * 1024


def test_auto_batch_size_is_derived_when_the_context_lacks_it():
    c = load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
             world_size=3)
    assert c.train_batch_size == 24


def test_unresolvable_auto_names_the_key_and_what_it_needs():
    ctx = {k: v for k, v in HF_CONTEXT.items() if k != "hidden_size"}
    msg = error_of(HF_STYLE, **ctx)
    assert "zero_optimization.reduce_bucket_size is \"auto\"" in msg
    assert "hidden size" in msg and "zero_optimization.stage3_param_persistence_threshold" in msg
    msg = error_of({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
    assert "optimizer.params.lr is \"auto\"" in msg and "learning rate" in msg


def test_auto_on_a_key_without_a_rule_is_an_error():
    msg = error_of({"train_batch_size": 8, "steps_per_print": "auto"})
    assert "steps_per_print" in msg and "no rule" in msg


# -- unknown and unsupported keys --------------------------------------------------------------

def test_typo_suggests_the_closest_key_with_its_dotted_path():
    msg = error_of({"train_batch_size": 8, "zero_optimization": {"stage": 3,
                                                                 "stage3_param_persitance_threshold": 1e4}})
    assert "'zero_optimization.stage3_param_persitance_threshold'" in msg
    assert "did you mean 'stage3_param_persistence_threshold'?" in msg
    msg = error_of({"train_batch_size": 8, "gradient_clipping": 1.0, "fp16": {"enabeld": True}})
    assert "'fp16.enabeld'" in msg and "did you mean 'enabled'?" in msg
    assert "did you mean 'train_micro_batch_size_per_gpu'?" in error_of({"train_micro_batch_size_per_gppu": 8})


def test_key_in_the_wrong_section_says_where_it_belongs():
    msg = error_of({"train_batch_size": 8, "stage3_max_live_parameters": 1e9})
    assert "belongs under 'zero_optimization'" in msg


def test_parameter_of_another_optimizer_is_named():
    msg = error_of({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}})
    assert "optimizer.params.momentum is not a parameter of AdamW (it is one of SGD)" in msg


@pytest.mark.parametrize("cfg, key", [
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": {"stage": 2, "round_robin_gradients": True}}, "zero_optimization.round_robin_gradients"),
    ({"pipeline": {"stages": 2}}, "pipeline"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
    ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
    ({"comms_logger": {"enabled": True, "verbose": False}}, "comms_logger"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity"),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pipeline_read": True}}},
     "zero_optimization.offload_optimizer.pipeline_read"),
])
def test_unimplemented_deepspeed_key_is_an_error(cfg, key):
    msg = error_of({"train_batch_size": 8, **cfg})
    assert f"{key} is a DeepSpeed option that zspeed does not support" in msg


def test_unimplemented_keys_that_request_nothing_are_accepted():
    c = load({"train_batch_size": 8, "flops_profiler": {"enabled": False, "profile_step": 1},
              "tensorboard": {"enabled": False}, "wandb": {}, "prescale_gradients": False,
              "zero_optimization": {"stage": 3, "sub_group_size": "1e9", "round_robin_gradients": False,
                                    "zero_hpz_partition_size": 1}})
    assert c.zero_stage == 3


def test_unsupported_optimizer_and_scheduler_types():
    msg = error_of({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {}},
                    "scheduler": {"type": "OneCycle", "params": {}}})
    assert "Lamb is a DeepSpeed optimizer that zspeed does not support" in msg
    assert "OneCycle is a DeepSpeed lr scheduler that zspeed does not support" in msg
    assert "did you mean 'SGD'?" in error_of({"train_batch_size": 8, "optimizer": {"type": "SDG"}})


def test_all_problems_are_reported_together():
    msg = error_of({"train_batch_size": 8, "pipeline": {"stages": 2}, "foo": 1,
                    "zero_optimization": {"stag": 1}})
    assert msg.startswith("3 problems")
    assert "pipeline" in msg and "'foo'" in msg and "did you mean 'stage'?" in msg


# -- invalid values ------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, fragment", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"gradient_clipping": -1.0}, "gradient_clipping must be >= 0"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "parameter offload needs stage 3"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "optimizer offload needs stage 1"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path is not set"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
     "zero_optimization.offload_param.device must be one of 'none', 'cpu', 'nvme'"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis must be >= 1"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale must be > 0"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas must lie in [0, 1)"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas must be a list of 2"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, "nesterov needs momentum > 0"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
     "scheduler.params.warmup_type must be one of 'log', 'linear'"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps is required"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}}},
     "scheduler.params.cos_min_ratio must lie in [0, 1]"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage must be a whole number (like 2"),
    ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "zero_optimization.reduce_bucket_size must be a whole number"),
    ({"wall_clock_breakdown": 1}, "wall_clock_breakdown must be true or false"),
    ({"steps_per_print": 0}, "steps_per_print must be >= 1"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16 and bf16 are the same setting"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True, "partition_activations": True}},
     "needs number_checkpoints"),
])
def test_invalid_values_are_clear_errors(cfg, fragment):
    assert fragment in error_of({"train_batch_size": 8, **cfg})


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="stage must be 0, 1, 2 or 3"):
        ZeroConfig(stage=4)


def test_config_objects_are_frozen_and_slotted():
    c = load({"train_batch_size": 8})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train_batch_size = 16  # type: ignore[misc]
    assert not hasattr(c, "__dict__") and not hasattr(c.zero_optimization, "__dict__")


# -- numbers, aliases, defaults --------------------------------------------------------------------

def test_numbers_may_be_strings_or_floats():
    c = load({"train_batch_size": "16", "gradient_clipping": "1.0", "wall_clock_breakdown": "true",
              "optimizer": {"type": "adamw", "params": {"lr": "1e-4", "betas": ["0.9", 0.95]}},
              "zero_optimization": {"stage": "2", "reduce_bucket_size": "5e8", "allgather_bucket_size": 2e8,
                                    "stage3_param_persistence_threshold": 1e4}})
    z = c.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size) == (2, 500_000_000, 200_000_000)
    assert z.stage3_param_persistence_threshold == 10_000 and isinstance(z.reduce_bucket_size, int)
    assert c.optimizer.type is OptimizerType.ADAMW and c.optimizer.params.lr == 1e-4
    assert c.optimizer.params.betas == (0.9, 0.95) and c.gradient_clipping == 1.0 and c.wall_clock_breakdown


def test_aliases_and_defaults():
    c = load({"train_batch_size": 8, "bfloat16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert c.precision is Precision.BF16
    z = c.zero_optimization
    assert z.stage3_gather_16bit_weights_on_model_save and z.overlap_comm  # DeepSpeed: on by default in stage 3
    assert not load({"train_batch_size": 8, "zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm
    d = load({"train_batch_size": 8})
    assert d.precision is Precision.FP32 and d.optimizer is None and d.scheduler is None
    assert d.activation_checkpointing is None and d.steps_per_print == 10
    assert d.zero_optimization.offload_optimizer.device is OffloadDevice.NONE


def test_full_config_from_a_file_round_trips(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 5,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10,
                                                           "warmup_type": "linear"}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 3},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/nv"},
                              "offload_param": {"device": "cpu", "pin_memory": True}},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                     "number_checkpoints": 4, "profile": True},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    c = load_config(path, world_size=4)
    assert c.train_batch_size == 16 and c.precision is Precision.FP16 and c.fp16.hysteresis == 3
    assert c.scheduler.type is SchedulerType.WARMUP_COSINE_LR and c.scheduler.params.warmup_type is WarmupType.LINEAR
    assert c.zero_optimization.offload_optimizer.nvme_path == "/tmp/nv"
    assert c.activation_checkpointing.number_checkpoints == 4
    again = load_config(json.loads(json.dumps(config_to_dict(c))), world_size=4)
    assert again == c


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json", world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  oops\n}')
    with pytest.raises(ConfigError, match=r"bad.json:3:3: invalid JSON"):
        load_config(bad, world_size=1)
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(dup, world_size=1)


def test_describe_keys_documents_every_key():
    docs = describe_keys()
    for k in ["train_batch_size", "fp16.loss_scale", "fp16.hysteresis", "bf16.enabled", "gradient_clipping",
              "zero_optimization.stage3_max_reuse_distance", "zero_optimization.offload_param.nvme_path",
              "activation_checkpointing.synchronize_checkpoint_boundary", "optimizer.params.momentum",
              "scheduler.params.cos_min_ratio", "steps_per_print", "wall_clock_breakdown"]:
        assert docs[k].strip(), k
    assert docs["optimizer.params.momentum"].startswith("[SGD]")
    assert "world_size" not in docs


# -- the optimizer factory ------------------------------------------------------------------------

def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _opt_config(opt: dict):
    return load({"train_batch_size": 1, "optimizer": opt}, world_size=1).optimizer


def test_deepspeed_adam_is_adamw_unless_adam_w_mode_is_false():
    o = build_optimizer(_params(), _opt_config({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}))
    assert type(o) is torch.optim.AdamW and o.defaults["weight_decay"] == 0.1 and o.defaults["lr"] == 0.01
    o = build_optimizer(_params(), _opt_config({"type": "Adam", "params": {"adam_w_mode": False}}))
    assert type(o) is torch.optim.Adam


def test_fused_on_cpu_else_foreach():
    params = _params()
    assert fused_supported(params)
    o = build_optimizer(params, _opt_config({"type": "AdamW", "params": {"betas": [0.8, 0.9]}}))
    assert o.defaults["fused"] and o.defaults["betas"] == (0.8, 0.9)
    o = build_optimizer(_params(), _opt_config({"type": "AdamW"}), fused=False)
    assert o.defaults["foreach"] and not o.defaults["fused"]
    doubles = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    assert not fused_supported(doubles)
    assert build_optimizer(doubles, _opt_config({"type": "AdamW"})).defaults["foreach"]


def test_sgd_and_param_groups_and_a_real_step():
    w, b = _params()
    o = build_optimizer([{"params": [w]}, {"params": [b], "weight_decay": 0.0}],
                        _opt_config({"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1}}))
    assert type(o) is torch.optim.SGD
    assert o.param_groups[0]["weight_decay"] == 0.1 and o.param_groups[1]["weight_decay"] == 0.0
    before = w.detach().clone()
    w.grad = torch.ones_like(w)
    o.step()
    torch.testing.assert_close(w.detach(), before - 0.5 * (1 + 0.1 * before))


def test_adamw8bit_without_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(ImportError, match=r"pip install 'zspeed\[quant\]'"):
        build_optimizer(_params(), _opt_config({"type": "AdamW8bit", "params": {"lr": 1e-3}}))


def test_aio_section_tunes_the_nvme_store(tmp_path):
    """DeepSpeed's `aio` section is parsed (not refused) and sets the NVMe store's concurrency and chunk."""
    from zspeed.train.param_offload import nvme_store_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "aio": {"block_size": 4 << 20, "queue_depth": 4, "thread_count": 2,
                               "single_submit": False, "overlap_events": True}}, world_size=1)
    store = nvme_store_config(tmp_path, cfg.aio)
    assert (store.io_threads, store.chunk_bytes) == (8, 4 << 20)
    defaults = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1).aio
    assert defaults.requests_in_flight == 8  # DeepSpeed's defaults: 1 thread x queue depth 8
    for bad, match in [({"block_size": 1000}, "multiple of 4096"), ({"queue_depth": 0}, ">= 1"),
                       ({"use_gds": True}, "GPUDirect"), ({"thread_cnt": 2}, "did you mean 'thread_count'")]:
        with pytest.raises(ConfigError, match=match):
            load_config({"train_micro_batch_size_per_gpu": 1, "aio": bad}, world_size=1)
