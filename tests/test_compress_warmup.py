"""Start-up kernel warm-up: each distinct compressed layer runs once per row count, nothing else runs."""
import torch
from torch import nn

from zspeed.compress import RTNConfig, quantize_model
from zspeed.compress.modules import QuantLinear
from zspeed.compress.warmup import warm_up_kernels


def _model() -> nn.Module:
    torch.manual_seed(0)
    # two blocks of identical shapes, plus one distinct layer: three QuantLinear shapes, five modules
    blocks = [nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 64, bias=False)) for _ in range(2)]
    return quantize_model(nn.Sequential(*blocks, nn.Linear(64, 96, bias=False)),
                          RTNConfig(bits=4, group_size=32, include=["*"], exclude=[]), progress=False)


def test_each_distinct_layer_runs_once_per_row_count(monkeypatch):
    model = _model()
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 5
    seen = []
    original = QuantLinear.forward
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x: seen.append((self.out_features, x.shape)) or
                        original(self, x))
    calls = warm_up_kernels(model.modules(), dtype=torch.float32, device=torch.device("cpu"), rows=(1, 3))
    assert calls == 6 == len(seen)
    assert sorted(seen) == sorted([(n, torch.Size([m, k])) for n, k in ((32, 64), (64, 32), (96, 64))
                                   for m in (1, 3)])


def test_layers_on_another_device_are_left_alone():
    assert warm_up_kernels(_model().modules(), dtype=torch.float32, device=torch.device("meta")) == 0


def test_server_loader_warms_resident_layers_only(monkeypatch, caplog):
    """zserve's loader tunes resident compressed layers at start-up and leaves streamed ones alone."""
    import logging
    from types import SimpleNamespace

    from zspeed.serve import model_loader
    from zspeed.serve.layers import ResidentLayers

    model = _model()
    calls = []
    monkeypatch.setattr("zspeed.compress.warmup.warm_up_kernels",
                        lambda modules, **kw: calls.append(sum(isinstance(m, QuantLinear) for m in modules)) or 7)
    gpu = SimpleNamespace(is_cuda=True, device=torch.device("cpu"), synchronize=lambda: None)
    with caplog.at_level(logging.INFO, logger=model_loader.log.name):
        model_loader._warm_up(ResidentLayers(list(model)), gpu, torch.float32)
    assert calls == [5] and "7 compressed-layer shapes x row counts tuned" in caplog.text
    model_loader._warm_up(SimpleNamespace(__len__=lambda: 1), gpu, torch.float32)  # streamed: not a ResidentLayers
    model_loader._warm_up(ResidentLayers(list(model)), SimpleNamespace(is_cuda=False), torch.float32)
    assert calls == [5]
