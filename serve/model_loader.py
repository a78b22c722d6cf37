"""Loading a Llama-family causal LM for serving: resident parts on the device, layers per offload policy.

The model's Hugging Face class is built on the ``meta`` device (code and
shapes, no memory), compressed modules from a ``zcompress`` folder are swapped
in, and then only what is needed is materialized, one tensor at a time from
the safetensors files: the embedding, final norm and output head on the
device, and the decoder layers either on the device (``offload none``) or in
a core :class:`TensorStore` on pinned CPU memory (``cpu``) or disk (``nvme``),
from where :class:`~zspeed.serve.layers.StreamedLayers` streams them. Resident
layers then have their sibling projections fused (``LoadConfig.fuse_projections``)
before their kernels are tuned.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from zspeed.compress.storage import module_from_spec
from zspeed.core.device import DeviceHandle
from zspeed.core.store import StoreConfig, TensorStore, Tier

from .attention import ATTN_IMPLEMENTATION
from .checkpoint import Checkpoint, CheckpointError, resolve_model_dir
from .layers import LayerSource, ResidentLayers, StreamedLayers
from .presets import PRESETS, is_complete, write_random_checkpoint
from .tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("zspeed.serve")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_SOURCE_FILE = "zserve_source.json"  # beside a DISK store: which checkpoint (and dtype) filled it


class Offload(enum.Enum):
    """Where decoder-layer weights live between uses."""

    NONE = "none"  # on the device, all of them
    CPU = "cpu"  # pinned host memory, streamed per step
    NVME = "nvme"  # files on disk (O_DIRECT), streamed per step


class FuseMode(enum.Enum):
    """Whether each decoder layer's sibling projections (q/k/v, gate/up) run as one matmul
    ([Note: fused projections] in zspeed.compress.fused)."""

    AUTO = "auto"  # where the layers are resident on the device; streamed layers are left as they are
    ON = "on"  # always; refused with offload (see [Note: no fusion of streamed layers])
    OFF = "off"  # never


# [Note: no fusion of streamed layers] With offload, one shell module runs every layer with that
# layer's tensors filled by name from the TensorStore ([Note: one shell, streamed weights]), and the
# store holds the checkpoint's separate q/k/v and gate/up tensors. Fusing would need the store to hold
# concatenated tensors under new names (and a DISK store to be rewritten), for little gain: a streamed
# step is dominated by weight transfers, not kernel launches. So AUTO leaves streamed layers alone and
# LoadConfig refuses ON with offload.


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadConfig:
    """What to load and where its weights live.

    model: a folder (Hugging Face or zcompress), a Hugging Face id in the
        local cache, or a preset name (needs ``random_weights``).
    random_weights: serve random weights of the preset's shape, written once to
        ``random_weights_dir`` (default ``~/.cache/zspeed/random/<name>``).
    num_layers: decoder layers of a preset (default: the preset's).
    offload / nvme_path / window: the offload policy, the disk store's folder,
        and K, the device slots the streamer rotates layers through.
    dtype: ``"auto"`` (the checkpoint's) or a torch dtype name.
    device: ``"auto"`` (CUDA if present), ``"cpu"`` or ``"cuda:N"``.
    fuse_projections: a :class:`FuseMode` (or its value): fuse q/k/v and gate/up of each
        resident layer into one matmul each (``auto``, the default: where layers are
        resident; ``on``: also an error where none can be fused; ``off``: never).
    """

    model: str
    random_weights: bool = False
    random_weights_dir: str | None = None
    num_layers: int | None = None
    offload: Offload = Offload.NONE
    nvme_path: str | None = None
    window: int = 2
    dtype: str = "auto"
    device: str = "auto"
    fuse_projections: FuseMode = FuseMode.AUTO
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", Offload(self.offload))
        self._check_fuse_projections()
        if self.offload is Offload.NVME and not self.nvme_path:
            raise ValueError("offload nvme needs nvme_path: the folder to keep layer files in")
        if self.window < 1:
            raise ValueError(f"window={self.window}: use at least 1 device slot (2 or more to overlap)")
        if self.dtype != "auto" and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype={self.dtype!r}: use 'auto' or a torch dtype name such as bfloat16")
        is_preset = self.model in PRESETS
        if is_preset and not self.random_weights:
            raise ValueError(f"{self.model!r} is a preset with no weights: pass random_weights (--random-weights)")
        if self.random_weights and not is_preset:
            raise ValueError(f"random_weights needs a preset name ({', '.join(PRESETS)}), got {self.model!r}")
        if self.num_layers is not None and not is_preset:
            raise ValueError("num_layers changes a preset's shape; a checkpoint's layers are fixed")

    def _check_fuse_projections(self) -> None:
        try:
            object.__setattr__(self, "fuse_projections", FuseMode(self.fuse_projections))
        except ValueError:
            choices = ", ".join(m.value for m in FuseMode)
            raise ValueError(f"fuse_projections={self.fuse_projections!r}: use one of {choices} "
                             "(--fuse-projections)") from None
        if self.fuse_projections is FuseMode.ON and self.offload is not Offload.NONE:
            raise ValueError(f"fuse_projections on (--fuse-projections on) needs resident layers, but offload is "
                             f"{self.offload.value}: streamed layers are filled by name from the tensor store, "
                             "which holds the separate projections; use offload none, or fuse_projections auto "
                             "(leaves streamed layers unfused) or off")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDescription:
    """What was loaded, for logs, ``ModelInfo`` and the runner's limits."""

    model_id: str
    source: str
    architecture: str
    vocab_size: int
    num_layers: int
    num_parameters: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    quantization: str
    offload: Offload
    fused_projections: int = 0  # sibling-projection groups fused (0: none); logged, ModelInfo has no field


@dataclass(eq=False, kw_only=True)
class LoadedModel:
    """A model ready to run: resident modules, a layer source and the tokenizer."""

    description: ModelDescription
    device: DeviceHandle
    embed: nn.Module
    rotary: nn.Module
    norm: nn.Module
    lm_head: nn.Module
    layers: LayerSource
    tokenizer: Tokenizer
    hf_config: object = field(repr=False)

    def close(self) -> None:
        self.layers.close()


def load_model(config: LoadConfig) -> LoadedModel:
    """Loads ``config.model`` (see :class:`LoadConfig`), logging what came from where and how long it took."""
    start = time.perf_counter()
    device = DeviceHandle.auto() if config.device == "auto" else DeviceHandle.for_device(config.device)
    directory = _locate(config)
    with Checkpoint(directory) as ckpt:
        hf_config = _hf_config(ckpt)
        dtype = _dtype(config.dtype, ckpt)
        skeleton, num_params = _skeleton(hf_config, dtype, ckpt)
        desc = _describe(config, directory, ckpt, hf_config, dtype, num_params)
        log.info("model %s: %s, %d layers, %.3g B parameters, %s, quantization %s, from %s (%s checkpoint)",
                 desc.model_id, desc.architecture, desc.num_layers, num_params / 1e9,
                 str(dtype).removeprefix("torch."), desc.quantization, directory, ckpt.kind)
        base = skeleton.model
        embed, norm, lm_head = _resident_parts(skeleton, ckpt, device, hf_config)
        with torch.device(device.device):
            rotary = type(base.rotary_emb)(config=hf_config)
        layers = _load_layers(config, skeleton, ckpt, device)
        desc = dataclasses.replace(desc, fused_projections=_fuse_projections(layers, config.fuse_projections))
        _warm_up(layers, device, dtype)  # after fusing: tunes the fused shapes
    loaded = LoadedModel(description=desc, device=device, embed=embed, rotary=rotary, norm=norm, lm_head=lm_head,
                         layers=layers, tokenizer=load_tokenizer(directory), hf_config=hf_config)
    log.info("loaded in %.1fs on %s; fused projections: %s; tokenizer: %s", time.perf_counter() - start, device,
             f"{desc.fused_projections} groups" if desc.fused_projections else "none", loaded.tokenizer.name)
    return loaded


def _fuse_projections(layers: LayerSource, mode: FuseMode) -> int:
    """Fuses the resident layers' sibling projections as ``mode`` asks (streamed layers: [Note: no fusion of
    streamed layers]); returns how many groups were fused. Groups ``fuse_projections`` leaves unfused (mixed
    formats, NF4) are logged: a warning under ON, information under AUTO."""
    if mode is FuseMode.OFF or not isinstance(layers, ResidentLayers):
        return 0
    from zspeed.compress.fuse import fuse_projections, fused_projections

    stack = nn.ModuleList(layers.modules)  # one call: one message naming layer.module of each skipped group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fuse_projections(stack)
    skipped = [_shorten(str(w.message)) for w in caught]
    for message in skipped:
        log.log(logging.WARNING if mode is FuseMode.ON else logging.INFO, "%s", message)
    groups = len(fused_projections(stack))
    if mode is FuseMode.ON and not groups:
        why = "\n".join(skipped) or "it has no q/k/v or gate/up sibling projections"
        raise ValueError(f"fuse_projections on (--fuse-projections on): no projections of this model could be "
                         f"fused; use fuse_projections auto or off. Why: {why}")
    log.info("projections: %d groups (q/k/v, gate/up) of %d layers fused into one matmul each", groups, len(stack))
    return groups


def _shorten(message: str, lines: int = 6) -> str:
    """``message`` with at most ``lines`` lines (one per skipped group: 160 for an NF4 Llama-70B)."""
    parts = message.splitlines()
    return "\n".join(parts[:lines] + [f"  ... and {len(parts) - lines} more"] if len(parts) > lines else parts)


def _warm_up(layers: LayerSource, device: DeviceHandle, dtype: torch.dtype) -> None:
    """Tune resident compressed layers' kernels now rather than in the first requests (zspeed.compress.warmup).

    Streamed layers are left to tune in their first steps: their modules run through a shared shell with
    each layer's tensors swapped in, and a step there is dominated by weight transfers anyway."""
    if not device.is_cuda or not isinstance(layers, ResidentLayers):
        return
    from zspeed.compress.warmup import warm_up_kernels

    start = time.perf_counter()
    modules = (m for i in range(len(layers)) for m in layers.acquire(i).modules())
    calls = warm_up_kernels(modules, dtype=dtype, device=device.device)
    if calls:
        device.synchronize()
        log.info("kernels: %d compressed-layer shapes x row counts tuned in %.1fs", calls, time.perf_counter() - start)


# -- locating ------------------------------------------------------------------------------------------------------
def _locate(config: LoadConfig) -> Path:
    if config.model not in PRESETS:
        return resolve_model_dir(config.model)
    layers = config.num_layers or PRESETS[config.model]["num_hidden_layers"]
    dtype = torch.bfloat16 if config.dtype == "auto" else getattr(torch, config.dtype)
    default = Path("~/.cache/zspeed/random").expanduser() / f"{config.model}-{layers}l-{str(dtype)[6:]}"
    out = Path(config.random_weights_dir).expanduser() if config.random_weights_dir else default
    if is_complete(out):
        log.info("random weights: reusing %s", out)
    else:
        log.info("random weights: writing a %s-shaped checkpoint (%d layers) to %s", config.model, layers, out)
        write_random_checkpoint(config.model, out, num_layers=config.num_layers, dtype=dtype,
                                progress=config.progress)
    return out


def _hf_config(ckpt: Checkpoint):
    from transformers import CONFIG_MAPPING

    model_type = ckpt.hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{ckpt.directory}: model_type {model_type!r} is not served; this server runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) models")
    fields = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    return CONFIG_MAPPING[model_type].from_dict(fields)


def _dtype(name: str, ckpt: Checkpoint) -> torch.dtype:
    if name == "auto":
        if ckpt.compressed is not None:
            name = ckpt.compressed.get("dtype", "float32")
        else:
            name = ckpt.hf_config.get("dtype") or ckpt.hf_config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{ckpt.directory}: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def _skeleton(hf_config, dtype: torch.dtype, ckpt: Checkpoint) -> tuple[nn.Module, int]:
    """The model on ``meta`` with compressed modules swapped in, and its dense parameter count."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config).to(dtype)
    num_params = sum(p.numel() for p in model.parameters())
    for name, spec in (ckpt.compressed or {}).get("modules", {}).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module_from_spec(spec, dtype))
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return model.eval(), num_params


def _describe(config: LoadConfig, directory: Path, ckpt: Checkpoint, hf_config, dtype: torch.dtype,
              num_params: int) -> ModelDescription:
    heads = hf_config.num_attention_heads
    formats = sorted({spec["format"] for spec in (ckpt.compressed or {}).get("modules", {}).values()})
    return ModelDescription(
        model_id=config.model, source=str(directory), architecture=hf_config.model_type,
        vocab_size=hf_config.vocab_size, num_layers=hf_config.num_hidden_layers, num_parameters=num_params,
        hidden_size=hf_config.hidden_size, num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        max_position_embeddings=hf_config.max_position_embeddings,
        sliding_window=_sliding_window(hf_config),
        eos_token_ids=_eos_ids(directory, hf_config), dtype=dtype,
        quantization="+".join(formats) or "none", offload=config.offload,
    )


def _sliding_window(hf_config) -> int | None:
    """The attention window when any layer uses one (Mistral, some Qwen2), else None."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(hf_config, "use_sliding_window", True) else None


def _eos_ids(directory: Path, hf_config) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = directory / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        ids.update([value] if isinstance(value, int) else value or [])
    return tuple(sorted(ids))


# -- materializing -------------------------------------------------------------------------------------------------
def _prefix(model: nn.Module, module: nn.Module) -> str:
    name = next(n for n, m in model.named_modules() if m is module)
    return f"{name}." if name else ""


def _read(ckpt: Checkpoint, key: str, like: torch.Tensor) -> torch.Tensor:
    """Tensor ``key`` from the checkpoint, checked against ``like`` and cast to its dtype."""
    tensor = ckpt.get(key)
    if tuple(tensor.shape) != tuple(like.shape):
        raise CheckpointError(f"{ckpt.directory}: tensor {key!r} is {tuple(tensor.shape)}, the model's config "
                              f"implies {tuple(like.shape)}")
    return tensor.to(like.dtype)


def _materialize(module: nn.Module, prefix: str, ckpt: Checkpoint, device: DeviceHandle) -> nn.Module:
    """Allocates ``module`` on the device and fills it from the checkpoint, tensor by tensor."""
    module.to_empty(device=device.device)
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            tensor.copy_(_read(ckpt, prefix + name, tensor))
    return module.requires_grad_(False)


def _resident_parts(model: nn.Module, ckpt: Checkpoint, device: DeviceHandle, hf_config):
    base = model.model
    embed = _materialize(base.embed_tokens, _prefix(model, base.embed_tokens), ckpt, device)
    norm = _materialize(base.norm, _prefix(model, base.norm), ckpt, device)
    if getattr(hf_config, "tie_word_embeddings", False) and type(model.lm_head) is nn.Linear:
        model.lm_head.weight = embed.weight
        lm_head = model.lm_head
    else:
        lm_head = _materialize(model.lm_head, _prefix(model, model.lm_head), ckpt, device)
    return embed, norm, lm_head


def _load_layers(config: LoadConfig, model: nn.Module, ckpt: Checkpoint, device: DeviceHandle) -> LayerSource:
    layers = model.model.layers
    prefix = _prefix(model, layers)
    bar = dict(desc=f"layers -> {config.offload.value}", unit="layer", disable=not config.progress)
    if config.offload is Offload.NONE:
        loaded = [_materialize(layers[i], f"{prefix}{i}.", ckpt, device) for i in tqdm(range(len(layers)), **bar)]
        log.info("weights: %d layers resident on %s", len(loaded), device)
        return ResidentLayers(loaded)
    shell = layers[0]
    names = [_layer_names(shell, layer, f"{prefix}{i}.") for i, layer in enumerate(layers)]
    store = _open_store(config, device)
    try:
        _fill_store(store, ckpt, shell, names, config, bar)
        source = StreamedLayers(shell=shell, store=store, names=names, device=device, window=config.window)
    except BaseException:
        store.close()
        raise
    log.info("weights: %d layers, %.3g GB in %r, streamed through %d device slots of %.3g MB on %s",
             len(names), store.nbytes() / 1e9, store, config.window, source.slot_bytes / config.window / 1e6, device)
    return source


def _layer_names(shell: nn.Module, layer: nn.Module, prefix: str) -> list[tuple[str, str]]:
    """Layer's ``(name in the shell, checkpoint key)`` pairs; every layer must match the shell's structure."""
    want = {n: (t.shape, t.dtype) for n, t in shell.state_dict(keep_vars=True).items()}
    have = {n: (t.shape, t.dtype) for n, t in layer.state_dict(keep_vars=True).items()}
    if have != want:
        raise CheckpointError(f"layer {prefix!r} differs in structure from the first layer (e.g. mixed compressed "
                              "formats); streamed offload needs identical layers: serve it with offload none")
    return [(name, prefix + name) for name in want]


def _open_store(config: LoadConfig, device: DeviceHandle) -> TensorStore:
    if config.offload is Offload.CPU:
        return TensorStore(config=StoreConfig(tier=Tier.CPU), device=device)
    return TensorStore(config=StoreConfig(tier=Tier.DISK, path=config.nvme_path), device=device)


def _fill_store(store: TensorStore, ckpt: Checkpoint, shell: nn.Module, names: list[list[tuple[str, str]]],
                config: LoadConfig, bar: dict) -> None:
    """Writes every layer's tensors into the store, one layer in flight; a DISK store filled from the
    same checkpoint files and dtype before is reused as it is."""
    like = shell.state_dict(keep_vars=True)
    source = {**ckpt.fingerprint(), "dtype": str(next(iter(like.values())).dtype)}
    marker = Path(config.nvme_path) / _SOURCE_FILE if store.tier is Tier.DISK else None
    if marker is not None and _reusable(store, marker, source, names, like):
        log.info("weights: reusing the layer files in %s (same checkpoint)", config.nvme_path)
        return
    if marker is not None:
        marker.unlink(missing_ok=True)
    for layer_names in tqdm(names, **bar):  # one group per layer: streamed in one copy ([Note: packed groups])
        store.put_group([(key, _read(ckpt, key, like[name]).contiguous()) for name, key in layer_names])
    if marker is not None:
        store.flush()
        marker.write_text(json.dumps(source))


def _reusable(store: TensorStore, marker: Path, source: dict, names, like) -> bool:
    try:
        if json.loads(marker.read_text()) != json.loads(json.dumps(source)):
            return False
    except (OSError, ValueError):
        return False
    for layer_names in names:
        for name, key in layer_names:
            if key not in store or not store.meta(key).matches(like[name]):
                return False
    return True

