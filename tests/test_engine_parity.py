"""Stages 0-3 × {fp32, bf16} × accumulation {1, 2} on 2 gloo ranks match a plain-PyTorch reference.

Every configuration of a model runs inside one spawn (a spawn costs seconds);
the reference depends only on precision and accumulation, so it is computed
once per pair. Losses are compared at every step, fp32 master weights at the end.
"""
import itertools

import pytest

from tests.dist_utils import run_distributed
from tests.engine_cases import TOLERANCE, Case, cached_reference, compare, run_engine

WORLD = 2


def _grid(topo, kind):
    cache, errors = {}, []
    for stage, precision, gas in itertools.product(range(4), ("fp32", "bf16"), (1, 2)):
        case = Case(kind=kind, stage=stage, precision=precision, gas=gas)
        got = run_engine(topo, case)
        want = cached_reference(cache, case, topo.world_size)
        errors += compare(got, want, tol=TOLERANCE[precision], label=f"{kind} stage {stage} {precision} gas {gas}")
    return errors


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_stages_match_reference(kind):
    errors = run_distributed(_grid, WORLD, kind)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
