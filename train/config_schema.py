"""Typed, validated training configuration: what a DeepSpeed JSON config means to zspeed.

Every section of a DeepSpeed config is a frozen, keyword-only dataclass here.
Each field carries the DeepSpeed key's meaning in its ``doc`` metadata (see
:func:`zspeed.train.config.describe_keys` for the dotted-key → meaning mapping),
and each dataclass validates its values when it is constructed, so an object of
these types is always a legal configuration.

The JSON is parsed into these classes in one place, :mod:`zspeed.train.config`;
nothing else reads the raw dictionary. Field names equal the DeepSpeed keys, so
the parser maps keys to fields without a translation table (aliases such as
``bfloat16`` are handled by the parser).
"""
from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A training config that zspeed cannot run: unknown or unsupported key, bad value."""


def key(doc: str, default: Any = MISSING, *, factory: Any = MISSING, json: bool = True) -> Any:
    """A config field: ``doc`` says what the DeepSpeed key means; ``json=False`` marks
    a field that is not read from the JSON (it comes from the caller)."""
    meta = {"doc": doc, "json": json}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class OptimizerType(enum.Enum):
    ADAM = "Adam"
    ADAMW = "AdamW"
    SGD = "SGD"
    ADAMW_8BIT = "AdamW8bit"


class SchedulerType(enum.Enum):
    WARMUP_LR = "WarmupLR"
    WARMUP_DECAY_LR = "WarmupDecayLR"
    WARMUP_COSINE_LR = "WarmupCosineLR"


class WarmupType(enum.Enum):
    LOG = "log"
    LINEAR = "linear"


class OffloadDevice(enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Precision(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


# -- optimizer ------------------------------------------------------------------

def _check_adam_like(p: Any, section: str) -> None:
    _check(p.lr >= 0, f"{section}.lr must be >= 0, got {p.lr}")
    _check(all(0.0 <= b < 1.0 for b in p.betas), f"{section}.betas must lie in [0, 1), got {list(p.betas)}")
    _check(p.eps > 0, f"{section}.eps must be > 0, got {p.eps}")
    _check(p.weight_decay >= 0, f"{section}.weight_decay must be >= 0, got {p.weight_decay}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamParams:
    """``optimizer.params`` for ``Adam`` and ``AdamW``."""

    SECTION: ClassVar[str] = "optimizer.params"
    lr: float = key("learning rate (DeepSpeed's default 1e-3)", 1e-3)
    betas: tuple[float, float] = key("(beta1, beta2): decay rates of the first and second moment", (0.9, 0.999))
    eps: float = key("term added to the denominator for numerical stability", 1e-8)
    weight_decay: float = key(
        "weight decay; decoupled (AdamW-style) unless adam_w_mode is false. Default 0, as in "
        "DeepSpeed's fused and CPU Adam (not torch.optim.AdamW's 1e-2)", 0.0)
    amsgrad: bool = key("use the AMSGrad variant", False)
    adam_w_mode: bool = key(
        "Adam only: apply weight decay decoupled, as AdamW. DeepSpeed's default is true, so "
        "DeepSpeed's 'Adam' is AdamW unless this is false; AdamW ignores it", True)
    torch_adam: bool = key(
        "DeepSpeed: use torch's Adam instead of its fused kernel. zspeed always uses torch's "
        "(fused where the device supports it), so both values give the same result", False)

    def __post_init__(self) -> None:
        _check_adam_like(self, self.SECTION)


@dataclass(frozen=True, kw_only=True, slots=True)
class SGDParams:
    """``optimizer.params`` for ``SGD``."""

    SECTION: ClassVar[str] = "optimizer.params"
    lr: float = key("learning rate", 1e-3)
    momentum: float = key("momentum factor", 0.0)
    dampening: float = key("dampening for momentum", 0.0)
    weight_decay: float = key("L2 penalty added to the gradient", 0.0)
    nesterov: bool = key("Nesterov momentum (needs momentum > 0 and dampening 0)", False)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check(self.lr >= 0, f"{s}.lr must be >= 0, got {self.lr}")
        _check(self.momentum >= 0, f"{s}.momentum must be >= 0, got {self.momentum}")
        _check(self.weight_decay >= 0, f"{s}.weight_decay must be >= 0, got {self.weight_decay}")
        _check(not self.nesterov or (self.momentum > 0 and self.dampening == 0),
               f"{s}.nesterov needs momentum > 0 and dampening 0 "
               f"(got momentum={self.momentum}, dampening={self.dampening})")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamW8bitParams:
    """``optimizer.params`` for ``AdamW8bit`` (bitsandbytes; not a DeepSpeed type)."""

    SECTION: ClassVar[str] = "optimizer.params"
    lr: float = key("learning rate", 1e-3)
    betas: tuple[float, float] = key("(beta1, beta2)", (0.9, 0.999))
    eps: float = key("term added to the denominator for numerical stability", 1e-8)
    weight_decay: float = key("decoupled weight decay (default 0, as for AdamW here)", 0.0)
    amsgrad: bool = key("use the AMSGrad variant", False)

    def __post_init__(self) -> None:
        _check_adam_like(self, self.SECTION)


OPTIMIZER_PARAMS: dict[OptimizerType, type] = {
    OptimizerType.ADAM: AdamParams,
    OptimizerType.ADAMW: AdamParams,
    OptimizerType.SGD: SGDParams,
    OptimizerType.ADAMW_8BIT: AdamW8bitParams,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """``optimizer``: which optimizer the engine builds, and its hyperparameters."""

    SECTION: ClassVar[str] = "optimizer"
    type: OptimizerType = key("Adam, AdamW, SGD or AdamW8bit (case-insensitive)")
    params: AdamParams | SGDParams | AdamW8bitParams = key("hyperparameters of that optimizer")

    def __post_init__(self) -> None:
        want = OPTIMIZER_PARAMS[self.type]
        _check(isinstance(self.params, want),
               f"optimizer.params for {self.type.value} must be {want.__name__}, got {type(self.params).__name__}")

    @property
    def lr(self) -> float:
        return self.params.lr


# -- scheduler ------------------------------------------------------------------

def _check_warmup(p: Any, section: str) -> None:
    _check(p.warmup_num_steps >= 0, f"{section}.warmup_num_steps must be >= 0, got {p.warmup_num_steps}")
    _check(p.last_batch_iteration >= -1, f"{section}.last_batch_iteration must be >= -1, got {p.last_batch_iteration}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupLRParams:
    """``scheduler.params`` for ``WarmupLR``: warm up from min to max lr, then hold."""

    SECTION: ClassVar[str] = "scheduler.params"
    warmup_min_lr: float = key("learning rate at step 0", 0.0)
    warmup_max_lr: float | None = key("learning rate reached after warmup; null = the optimizer's lr", None)
    warmup_num_steps: int = key("steps of warmup (DeepSpeed uses at least 2)", 1000)
    warmup_type: WarmupType = key("'log' (DeepSpeed's default) or 'linear' warmup curve", WarmupType.LOG)
    last_batch_iteration: int = key("index of the last step already taken; -1 starts fresh", -1)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check_warmup(self, s)
        _check(self.warmup_min_lr >= 0, f"{s}.warmup_min_lr must be >= 0, got {self.warmup_min_lr}")
        _check(self.warmup_max_lr is None or self.warmup_max_lr >= 0,
               f"{s}.warmup_max_lr must be >= 0, got {self.warmup_max_lr}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupDecayLRParams:
    """``scheduler.params`` for ``WarmupDecayLR``: WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    SECTION: ClassVar[str] = "scheduler.params"
    total_num_steps: int = key("step at which the learning rate reaches 0")
    warmup_min_lr: float = key("learning rate at step 0", 0.0)
    warmup_max_lr: float | None = key("learning rate reached after warmup; null = the optimizer's lr", None)
    warmup_num_steps: int = key("steps of warmup (DeepSpeed uses at least 2)", 1000)
    warmup_type: WarmupType = key("'log' or 'linear' warmup curve", WarmupType.LOG)
    last_batch_iteration: int = key("index of the last step already taken; -1 starts fresh", -1)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check_warmup(self, s)
        _check(self.total_num_steps >= 1, f"{s}.total_num_steps must be >= 1, got {self.total_num_steps}")
        _check(self.warmup_min_lr >= 0, f"{s}.warmup_min_lr must be >= 0, got {self.warmup_min_lr}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupCosineLRParams:
    """``scheduler.params`` for ``WarmupCosineLR``: ratios of the optimizer's lr,
    warmup from ``warmup_min_ratio`` to 1, then cosine decay to ``cos_min_ratio``."""

    SECTION: ClassVar[str] = "scheduler.params"
    total_num_steps: int = key("step at which the cosine reaches cos_min_ratio")
    warmup_min_ratio: float = key("lr ratio at step 0", 0.0)
    warmup_num_steps: int = key("steps of warmup (DeepSpeed uses at least 2)", 1000)
    cos_min_ratio: float = key("lr ratio at the end of the cosine", 0.0001)
    warmup_type: WarmupType = key("'log' or 'linear' warmup curve", WarmupType.LOG)
    last_batch_iteration: int = key("index of the last step already taken; -1 starts fresh", -1)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check_warmup(self, s)
        _check(self.total_num_steps >= 1, f"{s}.total_num_steps must be >= 1, got {self.total_num_steps}")
        for name in ("warmup_min_ratio", "cos_min_ratio"):
            v = getattr(self, name)
            _check(0.0 <= v <= 1.0, f"{s}.{name} must lie in [0, 1], got {v}")


SCHEDULER_PARAMS: dict[SchedulerType, type] = {
    SchedulerType.WARMUP_LR: WarmupLRParams,
    SchedulerType.WARMUP_DECAY_LR: WarmupDecayLRParams,
    SchedulerType.WARMUP_COSINE_LR: WarmupCosineLRParams,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """``scheduler``: the learning-rate schedule, stepped once per optimizer step."""

    SECTION: ClassVar[str] = "scheduler"
    type: SchedulerType = key("WarmupLR, WarmupDecayLR or WarmupCosineLR")
    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams = key("parameters of that schedule")

    def __post_init__(self) -> None:
        want = SCHEDULER_PARAMS[self.type]
        _check(isinstance(self.params, want),
               f"scheduler.params for {self.type.value} must be {want.__name__}, got {type(self.params).__name__}")


# -- precision ------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config:
    """``fp16``: fp16 compute with fp32 master weights and a loss scaler."""

    SECTION: ClassVar[str] = "fp16"
    enabled: bool = key("train in fp16", False)
    loss_scale: float = key("static loss scale; 0 selects the dynamic scaler", 0.0)
    initial_scale_power: int = key("the dynamic scaler starts at 2**initial_scale_power", 16)
    loss_scale_window: int = key("good steps after which the dynamic scale doubles", 1000)
    hysteresis: int = key("overflows tolerated before the dynamic scale is halved", 2)
    consecutive_hysteresis: bool = key("refill the hysteresis budget after every good step, "
                                       "not only when the scale grows", False)
    min_loss_scale: float = key("the dynamic scale never drops below this", 1.0)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check(self.loss_scale >= 0, f"{s}.loss_scale must be >= 0 (0 = dynamic), got {self.loss_scale}")
        _check(0 <= self.initial_scale_power < 128,
               f"{s}.initial_scale_power must be in [0, 128), got {self.initial_scale_power}")
        _check(self.loss_scale_window >= 1, f"{s}.loss_scale_window must be >= 1, got {self.loss_scale_window}")
        _check(self.hysteresis >= 1, f"{s}.hysteresis must be >= 1, got {self.hysteresis}")
        _check(self.min_loss_scale > 0, f"{s}.min_loss_scale must be > 0, got {self.min_loss_scale}")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class BF16Config:
    """``bf16`` (alias ``bfloat16``): bf16 compute with fp32 master weights and optimizer state."""

    SECTION: ClassVar[str] = "bf16"
    enabled: bool = key("train in bf16", False)


@dataclass(frozen=True, kw_only=True, slots=True)
class AioConfig:
    """``aio``: NVMe I/O tuning, as NVMe offload configs usually carry it. zspeed's NVMe
    store (core/store.py) keeps ``thread_count × queue_depth`` reads or writes in flight
    (one per I/O thread, O_DIRECT where the file system allows it) and moves data in
    ``block_size`` chunks where a transfer needs a bounce buffer."""

    SECTION: ClassVar[str] = "aio"
    block_size: int = key("bytes per I/O request (the store's transfer chunk; a multiple of 4096)", 1_048_576)
    queue_depth: int = key("requests in flight per I/O thread (zspeed: multiplies thread_count)", 8)
    thread_count: int = key("I/O threads (zspeed: threads x queue_depth requests in flight)", 1)
    single_submit: bool = key("libaio: submit requests one at a time; zspeed submits each request on "
                              "its own thread, so true and false behave alike", False)
    overlap_events: bool = key("libaio: overlap submission and completion; zspeed always overlaps", True)
    use_gds: bool = key("GPUDirect Storage; zspeed reads into pinned host memory, so this must be false",
                        False)

    def __post_init__(self) -> None:
        _check(self.block_size > 0 and self.block_size % 4096 == 0,
               f"aio.block_size must be a positive multiple of 4096 bytes, got {self.block_size}")
        _check(self.queue_depth >= 1 and self.thread_count >= 1,
               f"aio.queue_depth and aio.thread_count must be >= 1, got {self.queue_depth} and {self.thread_count}")
        _check(not self.use_gds, "aio.use_gds: zspeed does not support GPUDirect Storage; set it to false")

    @property
    def requests_in_flight(self) -> int:
        return self.thread_count * self.queue_depth


# -- ZeRO -----------------------------------------------------------------------

def _check_offload(o: Any, section: str) -> None:
    _check(o.device is not OffloadDevice.NVME or bool(o.nvme_path),
           f"{section}.device is 'nvme' but {section}.nvme_path is not set; "
           "give the folder on the NVMe drive where zspeed may write swap files")
    _check(o.buffer_count >= 1, f"{section}.buffer_count must be >= 1, got {o.buffer_count}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: keep optimizer state (and fp32 master
    weights) on the CPU or NVMe and run the optimizer step there (stages 1-3)."""

    SECTION: ClassVar[str] = "zero_optimization.offload_optimizer"
    device: OffloadDevice = key("'none', 'cpu' or 'nvme'", OffloadDevice.NONE)
    nvme_path: str | None = key("folder for NVMe swap files (required for 'nvme')", None)
    pin_memory: bool = key("use page-locked host buffers for faster device transfers", False)
    buffer_count: int = key("number of swap buffers for NVMe optimizer state", 4)
    delayed_update: int | None = key(
        "zspeed extension, not a DeepSpeed key: the delayed parameter update of the ZeRO-Offload paper. "
        "After this many exact warm-up steps, each step's CPU update runs during the next step's forward "
        "and backward, so the parameters a step computes with are one update stale (clipping and the fp16 "
        "check still use the step's own gradients); null = off (every step exact)", None)
    speculative_update: bool = key(
        "zspeed extension, not a DeepSpeed key: with gradient clipping (and without fp16), start each group's "
        "CPU update during backward as if the clip will not fire, into a second copy of the fp32 masters and "
        "Adam moments; if the global norm then calls for clipping, the speculative results are dropped and the "
        "update reruns from the untouched state; a step speculates only if the step before it was not clipped. "
        "Exact either way; costs 12 more bytes of host memory per parameter; torch's fused Adam/AdamW only, "
        "CPU (not NVMe) offload", False)
    host_threads: int = key(
        "zspeed extension, not a DeepSpeed key: CPU threads of the host optimizer update; 0 = auto: the "
        "CPUs this process may run on divided by the processes of its node, less two for the threads that "
        "drive the GPU (torchrun's OMP_NUM_THREADS=1 default would leave one thread per rank to a "
        "memory-bound update of the whole model)", 0)
    device_share: float = key(
        "zspeed extension, not a DeepSpeed key: the fraction of the parameters (whole groups, the first units "
        "first) whose Adam/AdamW update runs on the GPU while the CPU updates the rest; their fp32 masters and "
        "moments stay in (pinned) host memory and stream through a few device buffers, so it costs ~384 MiB of "
        "GPU memory, not 12 bytes per parameter. 0 = every update on the CPU (DeepSpeed's behaviour); the best "
        "share balances the host's update rate against the PCIe link's (benchmarks/bench_device_adam.py "
        "measures both; 0.75 on an H100 with 16 host cores). Torch's fused Adam/AdamW without amsgrad, "
        "CUDA, 'cpu' offload, no delayed_update; with offload_param the groups the parameter store holds stay "
        "on the CPU", 0.0)
    ratio: float = key(
        "DeepSpeed's Twin-Flow key: the fraction of the optimizer state offloaded to the CPU; the first 1 - ratio "
        "of the parameters (whole groups, the first units first) keep their fp32 masters and moments in GPU "
        "memory (12 bytes per parameter) and are updated there, costing no PCIe traffic; the rest are offloaded "
        "as device_share says. 1 = everything offloaded. Stages 1-3 (DeepSpeed: stage 3 only); the same "
        "conditions as device_share (torch's fused Adam/AdamW, CUDA, 'cpu' offload, no delayed_update)", 1.0)
    prefetch_depth: int = key(
        "zspeed extension, not a DeepSpeed key: with device_share, how many chunks (8 Mi elements) of the "
        "streamed groups' state may be on their way to the GPU at once during backward, uploaded ahead of the "
        "update into memory backward has freed under the forward's peak; a few keep the link free for the other "
        "groups' parameters (measured on an H100, 1.1 B parameters: 16 best; all at once was slower than none); "
        "0 = no prefetch", 16)
    overlap_forward: bool = key(
        "zspeed extension, not a DeepSpeed key: step() returns once every update is started, and each updated "
        "group reaches the device when the next forward first calls a module owning one of its parameters, so "
        "that forward runs behind the update instead of after it (exact: the same values, published later). "
        "Not with delayed_update or offload_param. Between step() and the next forward the module's parameters may "
        "still hold the old values: read them through the engine (state dicts, checkpoints and exports publish "
        "first) or call engine.publish_updates(); a model that reads a parameter outside the forward of a "
        "module owning it (not the case in Hugging Face models) must not use it", False)

    def __post_init__(self) -> None:
        _check_offload(self, self.SECTION)
        _check(self.delayed_update is None or self.delayed_update >= 0,
               f"{self.SECTION}.delayed_update must be >= 0 (warm-up steps) or null (off), got {self.delayed_update}")
        _check(not (self.speculative_update and self.device is OffloadDevice.NVME),
               f"{self.SECTION}.speculative_update needs device 'cpu': the NVMe store swaps state in and out "
               "per group; turn it off or offload to 'cpu'")
        _check(not (self.speculative_update and self.delayed_update is not None),
               f"{self.SECTION}.speculative_update and delayed_update both overlap the update with the device; "
               "set one of them")
        _check(isinstance(self.host_threads, int) and self.host_threads >= 0,
               f"{self.SECTION}.host_threads must be an integer >= 0 (0 = auto), got {self.host_threads!r}")
        _check(0.0 <= self.device_share <= 1.0,
               f"{self.SECTION}.device_share is a fraction of the parameters, 0 to 1; got {self.device_share!r}")
        _check(isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0,
               f"{self.SECTION}.ratio is the fraction of the optimizer state offloaded, 0 to 1; got {self.ratio!r}")
        for asked, what, off in ((self.device_share > 0, "device_share", "set device_share to 0"),
                                 (self.ratio < 1, "ratio < 1", "set ratio to 1")):
            if asked:  # part of the update on the GPU, from (or instead of) host-resident state
                _check(self.device is not OffloadDevice.NVME,
                       f"{self.SECTION}.{what} runs part of the update on the GPU with its state in host memory or "
                       f"GPU memory; with 'nvme' the state is on disk. Offload to 'cpu' or {off}")
                _check(self.delayed_update is None,
                       f"{self.SECTION}.{what} and delayed_update do not combine (the GPU's part would be exact "
                       "while the rest is one step stale); set one of them")
        _check(isinstance(self.prefetch_depth, int) and self.prefetch_depth >= 0,
               f"{self.SECTION}.prefetch_depth must be an integer >= 0 (0 = no prefetch), "
               f"got {self.prefetch_depth!r}")
        _check(not (self.overlap_forward and self.delayed_update is not None),
               f"{self.SECTION}.overlap_forward and delayed_update both publish the update late (delayed_update "
               "one whole step late); set one of them")

    @property
    def enabled(self) -> bool:
        return self.device is not OffloadDevice.NONE


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param``: keep parameter shards on the CPU or NVMe,
    streamed to the device ahead of use (stage 3 only)."""

    SECTION: ClassVar[str] = "zero_optimization.offload_param"
    device: OffloadDevice = key("'none', 'cpu' or 'nvme'", OffloadDevice.NONE)
    nvme_path: str | None = key("folder for NVMe swap files (required for 'nvme')", None)
    pin_memory: bool = key("use page-locked host buffers for faster device transfers", False)
    buffer_count: int = key("number of parameter swap buffers for NVMe", 5)
    buffer_size: int = key("elements per parameter swap buffer for NVMe", 100_000_000)
    max_in_cpu: int = key("elements of parameters kept in CPU memory when offloading to NVMe", 1_000_000_000)

    def __post_init__(self) -> None:
        _check_offload(self, self.SECTION)
        s = self.SECTION
        _check(self.buffer_size >= 1, f"{s}.buffer_size must be >= 1, got {self.buffer_size}")
        _check(self.max_in_cpu >= 0, f"{s}.max_in_cpu must be >= 0, got {self.max_in_cpu}")

    @property
    def enabled(self) -> bool:
        return self.device is not OffloadDevice.NONE


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """``zero_optimization``: what is partitioned across ranks, and how communication is bucketed."""

    SECTION: ClassVar[str] = "zero_optimization"
    stage: int = key("0: none; 1: optimizer state; 2: + gradients; 3: + parameters", 0)
    overlap_comm: bool = key("overlap gradient reduction with backward (DeepSpeed's default: "
                             "true for stage 3, false otherwise)", False)
    contiguous_gradients: bool = key("copy gradients into one contiguous buffer as they are produced", True)
    reduce_scatter: bool = key("reduce gradients with reduce-scatter instead of all-reduce", True)
    reduce_bucket_size: int = key("elements reduced at once", 500_000_000)
    allgather_partitions: bool = key("all-gather updated partitions (instead of broadcasts) after the step", True)
    allgather_bucket_size: int = key("elements all-gathered at once (stages 1-2)", 500_000_000)
    stage3_prefetch_bucket_size: int = key("stage 3: elements of parameters prefetched ahead of use", 50_000_000)
    stage3_param_persistence_threshold: int = key(
        "stage 3: parameters with fewer elements stay gathered (not partitioned)", 100_000)
    stage3_max_live_parameters: int = key("stage 3: most parameter elements gathered at once per rank",
                                          1_000_000_000)
    stage3_max_reuse_distance: int = key(
        "stage 3: keep a parameter gathered if it is used again within this many elements", 1_000_000_000)
    stage3_gather_16bit_weights_on_model_save: bool = key(
        "stage 3: gather the full 16-bit weights when the model is saved (alias "
        "stage3_gather_fp16_weights_on_model_save)", False)
    offload_optimizer: OffloadOptimizerConfig = key("optimizer-state offload", factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = key("parameter offload (stage 3)", factory=OffloadParamConfig)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check(self.stage in (0, 1, 2, 3), f"{s}.stage must be 0, 1, 2 or 3, got {self.stage}")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_max_live_parameters"):
            _check(getattr(self, name) >= 1, f"{s}.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stage3_param_persistence_threshold", "stage3_max_reuse_distance"):
            _check(getattr(self, name) >= 0, f"{s}.{name} must be >= 0, got {getattr(self, name)}")
        _check(not self.offload_param.enabled or self.stage == 3,
               f"{s}.offload_param.device is '{self.offload_param.device.value}' but stage is {self.stage}; "
               "parameter offload needs stage 3 (only stage 3 partitions parameters)")
        _check(not self.offload_optimizer.enabled or self.stage >= 1,
               f"{s}.offload_optimizer.device is '{self.offload_optimizer.device.value}' but stage is 0; "
               "optimizer offload needs stage 1, 2 or 3")


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: how checkpointed activations are kept."""

    SECTION: ClassVar[str] = "activation_checkpointing"
    partition_activations: bool = key("partition checkpointed activations across model-parallel ranks", False)
    cpu_checkpointing: bool = key("move checkpointed activations to the CPU", False)
    contiguous_memory_optimization: bool = key("copy checkpoints into one contiguous buffer", False)
    number_checkpoints: int | None = key("number of checkpoints per forward (for the contiguous buffer)", None)
    synchronize_checkpoint_boundary: bool = key("synchronize the device at each checkpoint boundary", False)
    profile: bool = key("time the forward and recompute of checkpointed blocks", False)

    def __post_init__(self) -> None:
        s = self.SECTION
        _check(self.number_checkpoints is None or self.number_checkpoints >= 1,
               f"{s}.number_checkpoints must be >= 1, got {self.number_checkpoints}")
        _check(not self.contiguous_memory_optimization or self.partition_activations,
               f"{s}.contiguous_memory_optimization needs partition_activations (as in DeepSpeed)")
        _check(not self.contiguous_memory_optimization or self.number_checkpoints is not None,
               f"{s}.contiguous_memory_optimization needs number_checkpoints (as in DeepSpeed)")


# -- the whole config -------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class ZSpeedConfig:
    """A whole training config, consistent with the world size it was resolved for.

    Build it with :func:`zspeed.train.config.load_config`. The three batch sizes
    always satisfy ``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * world_size``.
    """

    SECTION: ClassVar[str] = ""
    world_size: int = key("data-parallel ranks the batch sizes were resolved for", json=False)
    train_batch_size: int = key("samples per optimizer step, over all ranks")
    train_micro_batch_size_per_gpu: int = key("samples per forward/backward on one rank")
    gradient_accumulation_steps: int = key("micro-batches accumulated per optimizer step")
    optimizer: OptimizerConfig | None = key("the optimizer; null = the client passes its own", None)
    scheduler: SchedulerConfig | None = key("the lr schedule; null = none (or the client's)", None)
    fp16: FP16Config = key("fp16 mixed precision", factory=FP16Config)
    bf16: BF16Config = key("bf16 mixed precision", factory=BF16Config)
    gradient_clipping: float = key("clip the global gradient norm to this (0 = no clipping)", 0.0)
    zero_optimization: ZeroConfig = key("ZeRO partitioning", factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = key(
        "activation checkpointing settings; null when the section is absent", None)
    aio: AioConfig = key("NVMe I/O tuning for offload to NVMe", factory=AioConfig)
    steps_per_print: int = key("log every this many optimizer steps", 10)
    wall_clock_breakdown: bool = key("time forward, backward and step separately and log them", False)
    zero_allow_untested_optimizer: bool = key(
        "DeepSpeed: permit optimizers it has not tested with ZeRO. zspeed runs every optimizer "
        "it builds with every stage; recorded for compatibility", False)

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.world_size
        _check(self.train_batch_size == product,
               f"train_batch_size ({self.train_batch_size}) != train_micro_batch_size_per_gpu "
               f"({self.train_micro_batch_size_per_gpu}) × gradient_accumulation_steps "
               f"({self.gradient_accumulation_steps}) × world_size ({self.world_size}) = {product}")
        _check(not (self.fp16.enabled and self.bf16.enabled),
               "fp16.enabled and bf16.enabled are both true; enable at most one")
        _check(self.gradient_clipping >= 0, f"gradient_clipping must be >= 0 (0 = off), got {self.gradient_clipping}")
        _check(self.steps_per_print >= 1, f"steps_per_print must be >= 1, got {self.steps_per_print}")

    @property
    def precision(self) -> Precision:
        if self.fp16.enabled:
            return Precision.FP16
        if self.bf16.enabled:
            return Precision.BF16
        return Precision.FP32

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage
