"""Fused sibling projections in the server (``LoadConfig.fuse_projections``, ``zserve --fuse-projections``):
resident layers fused, the same greedy tokens as unfused, streamed layers left alone, bad settings refused."""
from __future__ import annotations

import logging

import pytest
from torch import nn

from tests.serve_cases import PROMPTS, Reference, build_tiny_model, load_tiny
from tests.test_serve_runner import generate_all, make_engine
from zspeed.compress import DEFAULT_EXCLUDE, NF4Config, RTNConfig, load_compressed, quantize_model, save_compressed
from zspeed.compress.fused import FusedProjection, ProjectionSlice
from zspeed.serve.cli import main as zserve_main
from zspeed.serve.layers import ResidentLayers
from zspeed.serve.model_loader import FuseMode, LoadConfig, _fuse_projections

GROUPS = ("self_attn.q_proj+k_proj+v_proj", "mlp.gate_proj+up_proj")


def fused_names(model) -> list[list[str]]:
    """Each resident layer's ``FusedProjection`` modules by name (streamed: the shell's, as one layer)."""
    layers = model.layers.modules if isinstance(model.layers, ResidentLayers) else [model.layers.shell]
    return [sorted(n for n, m in layer.named_modules() if isinstance(m, FusedProjection)) for layer in layers]


def served_tokens(model, prompts, graphs=None) -> list[tuple[int, ...]]:
    engine, runner = make_engine(model, graphs=graphs)
    with engine:
        results = generate_all(engine, prompts, ignore_eos=True)
    runner.close()
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    """The tiny model quantized to INT4 (RTN, groups of 32) in a zcompress folder, and its reference outputs."""
    model = build_tiny_model()
    quantize_model(model, RTNConfig(bits=4, group_size=32), progress=False)
    out = tmp_path_factory.mktemp("tiny-int4")
    save_compressed(model, out)
    return out, Reference(load_compressed(out))


@pytest.mark.parametrize("graphs", [None, True], ids=["layers", "split"])
@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_fused_layers_give_the_unfused_greedy_tokens(tiny_dir, reference, int4_dir, kind, graphs):
    """ON and AUTO (resident) fuse q/k/v and gate/up of every layer; the greedy tokens equal OFF's and the
    unfused reference model's, run layer by layer and split around attention as CUDA graphs are."""
    folder, expected = (tiny_dir, reference) if kind == "dense" else int4_dir
    prompts = PROMPTS[:4]
    off = load_tiny(folder, fuse_projections="off")
    assert fused_names(off) == [[]] * 3 and off.description.fused_projections == 0
    assert not any(isinstance(m, ProjectionSlice) for layer in off.layers.modules for m in layer.modules())
    want = served_tokens(off, prompts, graphs)
    assert want == [expected.greedy(p, ignore_eos=True) for p in prompts]
    for mode in (FuseMode.ON, "auto"):
        on = load_tiny(folder, fuse_projections=mode)
        assert fused_names(on) == [sorted(GROUPS)] * 3 and on.description.fused_projections == 6
        attn = on.layers.modules[0].self_attn
        assert isinstance(attn.k_proj, ProjectionSlice) and attn.k_proj.fused is getattr(attn, "q_proj+k_proj+v_proj")
        if kind == "int4":
            assert type(attn.k_proj.fused.linear).__name__ == "QuantLinear"
        assert served_tokens(on, prompts, graphs) == want, mode


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_streamed_layers_are_left_unfused_and_on_is_refused(tiny_dir, reference, tmp_path, offload):
    nvme = str(tmp_path / "nvme")
    with pytest.raises(ValueError, match=f"needs resident layers, but offload is {offload}.*use offload none"):
        LoadConfig(model=str(tiny_dir), offload=offload, nvme_path=nvme, fuse_projections="on")
    model = load_tiny(tiny_dir, offload=offload, nvme_path=nvme)  # AUTO
    assert fused_names(model) == [[]] and model.description.fused_projections == 0
    assert served_tokens(model, PROMPTS[:2]) == [reference.greedy(p, ignore_eos=True) for p in PROMPTS[:2]]


def test_unfusable_groups_reach_the_log(tiny_dir, tmp_path, caplog):
    """NF4 modules cannot be fused: AUTO serves them unfused and says why in the log, ON refuses. With q/k
    quantized and v_proj dense, ON fuses gate/up and warns about q/k/v."""
    nf4 = build_tiny_model()
    quantize_model(nf4, NF4Config(blocksize=32), progress=False)
    save_compressed(nf4, tmp_path / "nf4")
    with caplog.at_level(logging.INFO, logger="zspeed.serve"):
        model = load_tiny(tmp_path / "nf4")
    assert model.description.fused_projections == 0 and fused_names(model) == [[]] * 3
    assert "left these groups unfused" in caplog.text and "NF4Linear cannot be fused" in caplog.text
    assert "... and 1 more" in caplog.text, "6 groups skipped: the log names 5"
    with pytest.raises(ValueError, match="no projections of this model could be fused; use fuse_projections auto"):
        load_tiny(tmp_path / "nf4", fuse_projections="on")

    mixed = build_tiny_model()
    quantize_model(mixed, RTNConfig(bits=4, group_size=32, exclude=(*DEFAULT_EXCLUDE, "*.v_proj")), progress=False)
    save_compressed(mixed, tmp_path / "mixed")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zspeed.serve"):
        model = load_tiny(tmp_path / "mixed", fuse_projections="on")
    assert fused_names(model) == [["mlp.gate_proj+up_proj"]] * 3 and model.description.fused_projections == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "0.self_attn.{q_proj,k_proj,v_proj}: different module types" in warned[0]
    assert "fused projections: 3 groups" in caplog.text
    quantized = Reference(load_compressed(tmp_path / "mixed"))
    assert served_tokens(model, PROMPTS[:2]) == [quantized.greedy(p, ignore_eos=True) for p in PROMPTS[:2]]


def test_layers_without_sibling_projections():
    """Layers of another architecture (no q/k/v or gate/up children): AUTO leaves them, ON says why not."""
    layers = ResidentLayers([nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(2)])
    assert _fuse_projections(layers, FuseMode.AUTO) == 0
    assert not any(isinstance(m, FusedProjection) for layer in layers.modules for m in layer.modules())
    with pytest.raises(ValueError, match="it has no q/k/v or gate/up sibling projections"):
        _fuse_projections(layers, FuseMode.ON)


def test_bad_settings_are_refused(tiny_dir, capsys):
    for bad in ("maybe", "ON", True, None):
        with pytest.raises(ValueError, match=r"fuse_projections=.*: use one of auto, on, off \(--fuse-projections\)"):
            LoadConfig(model=str(tiny_dir), fuse_projections=bad)
    assert LoadConfig(model=str(tiny_dir)).fuse_projections is FuseMode.AUTO
    assert LoadConfig(model=str(tiny_dir), fuse_projections="off").fuse_projections is FuseMode.OFF
    with pytest.raises(SystemExit) as exit_info:
        zserve_main(["--model", str(tiny_dir), "--fuse-projections", "maybe"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--fuse-projections: invalid choice: 'maybe'" in err and "on" in err
    assert zserve_main(["--model", str(tiny_dir), "--offload", "cpu", "--fuse-projections", "on"]) == 2
    assert "fuse_projections on (--fuse-projections on) needs resident layers, but offload is cpu" in \
        capsys.readouterr().err
