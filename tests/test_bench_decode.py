"""benchmarks/bench_decode.py on the CPU: repeated greedy runs from the same position repeat themselves.

Recent transformers' static cache layers keep their own write position (a tensor each step advances); the
benchmark rewinds it with its own, or a third run of the same length writes past the cache's end.
"""
import torch

from tests.benchmark_scripts import load_benchmark


def _bench():
    return load_benchmark("bench_decode")


def test_repeated_runs_decode_the_same_tokens():
    bench = _bench()
    torch.manual_seed(0)
    model = bench.build(2, "cpu", tiny=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    tokens = 6
    dec = bench.Decoder(model, prompt, max_len=prompt.shape[1] + tokens + 1)
    runs = [dec.run(tokens)[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    # the same tokens as a fresh decoder's single run: nothing leaks from one run into the next
    fresh = bench.Decoder(model, prompt, max_len=prompt.shape[1] + tokens + 1)
    assert fresh.run(tokens)[0] == runs[0]
    assert int(dec.pos) == prompt.shape[1]


def test_built_model_has_a_real_rotary_table():
    """``build`` allocates on the meta device and then ``to_empty``: parameters are drawn, and the rotary table (a
    buffer) is computed, not left as whatever memory the allocator handed back (NaN at times, once a flaky test)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    bench = _bench()
    for _ in range(3):
        model = bench.build(1, "cpu", tiny=True)
        want = LlamaRotaryEmbedding(config=model.config).inv_freq
        got = model.model.rotary_emb.inv_freq
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert all(torch.isfinite(b).all() for b in model.buffers())


def test_kernel_kinds():
    bench = _bench()
    assert bench.kernel_kind("stationary_tma_kernel") == "zspeed"
    # the GEMVs on tensor cores, counted as "other" by the substrings before (session 36's H200 profile)
    assert bench.kernel_kind("dense_mma_w4_fold_kernel") == "zspeed"
    assert bench.kernel_kind("dense_mma_w4_kernel") == "zspeed"
    assert bench.kernel_kind("_slot_attention_kernel") == "attention"
    assert bench.kernel_kind("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128>") == "cuBLAS"
    assert bench.kernel_kind("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT") == "cuBLAS"
    assert bench.kernel_kind("cudnn_generated_fort_native_sdpa_sm80_flash_fprop") == "attention"
    assert bench.kernel_kind("triton_poi_fused_mul_silu_9") == "inductor"
    assert bench.kernel_kind("void at::native::reduce_kernel") == "other"


def test_fused_systems_decode_like_the_plain_ones():
    """``--fuse``: q/k/v and gate/up fused into one matmul each decode the same tokens, bf16 and INT4."""
    bench = _bench()
    torch.manual_seed(0)
    model = bench.build(2, "cpu", tiny=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    int4 = bench.quantized(model, 4)
    for plain in (model, int4):
        fused = bench.fused(plain, copy_first=True)
        assert len([m for m in fused.modules() if type(m).__name__ == "FusedProjection"]) == 4
        with torch.no_grad():
            want = plain(input_ids=prompt).logits.float()
            got = fused(input_ids=prompt).logits.float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        runs = [bench.Decoder(m, prompt, max_len=prompt.shape[1] + 5).run(4)[0] for m in (plain, fused)]
        assert runs[0] == runs[1]
    assert bench.chosen_systems(bench_args(fuse=True)) == ["bf16", "zspeed-int4", "zspeed-int8", "bf16+fused",
                                                           "zspeed-int4+fused"]


def bench_args(**kw):
    import argparse

    return argparse.Namespace(**{"systems": None, "head": False, "fuse": False, **kw})


def test_inductor_pdl_is_set_for_every_system_or_refused(monkeypatch, tmp_path):
    """``--inductor-pdl`` turns on Inductor's programmatic dependent launch before any system compiles (every system
    alike), and a torch whose Inductor lacks the switch is told so instead of running without it."""
    import sys

    import torch._inductor.config as inductor_config

    bench = _bench()
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", False, raising=False)
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--dry-run", "--inductor-pdl", "--systems", "bf16",
                                      "--json", str(out)])
    assert bench.main() == 0 and inductor_config.triton.enable_pdl is True and out.exists()
    monkeypatch.delattr(inductor_config.triton, "enable_pdl")
    assert bench.main() == 2


def test_json_records_the_tuners_pick_for_each_shape(monkeypatch):
    """``--json`` carries the kernel tuner's pick for each key it tuned, with the config's fields that differ from
    their defaults, so that two decode runs can be compared shape by shape."""
    from zspeed.kernels import _word

    bench = _bench()
    key = ("gemv", _word.FMT_W4, 128, True, 1, 6144, 4096, "torch.bfloat16")
    picked = _word.WordConfig(1, 8, 256, 4, 8, row_blocks=2, dense_mma=True, fold=True, k_warps=8, late_sums=1)
    monkeypatch.setattr(_word, "_BEST", {key: picked})
    assert bench.tuner_picks() == [{"key": repr(key), "config": {
        "block_m": 1, "block_n": 8, "block_w": 256, "split_k": 4, "warps": 8, "row_blocks": 2, "dense_mma": True,
        "fold": True, "k_warps": 8, "late_sums": 1}}]


def test_rows_carry_the_wall_time_of_each_phase(monkeypatch, tmp_path, capsys):
    """Each system's row (and a printed line) gives the wall time of its phases, so that a GPU run's time can be
    planned: a quantized system's quantization and logits check, and every system's prefill, first step and capture."""
    import json
    import sys

    bench = _bench()
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--dry-run", "--systems", "bf16,zspeed-int4", "--json",
                                      str(out)])
    assert bench.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows[1]["phase_seconds"]) == ["quantize", "logits check", "prefill", "first step", "capture"]
    assert all(v >= 0 for r in rows for v in r["phase_seconds"].values())
    assert "zspeed-int4: wall time by phase: quantize" in capsys.readouterr().out


def test_the_cache_goes_in_by_the_keyword_the_model_takes():
    """``cache`` where the installed transformers' forward names it (``past_key_values`` is deprecated there, to go
    in 5.40): decoding draws no deprecation of it; ``past_key_values`` where ``forward`` has no ``cache`` (older
    transformers, the GPU image's 5.17)."""
    import warnings

    bench = _bench()
    model = bench.build(1, "cpu", tiny=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        tokens = bench.Decoder(model, prompt, max_len=prompt.shape[1] + 3).run(2)[0]
    assert len(tokens) == 2

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, cache_position=None, use_cache=None):
            return input_ids

    assert bench.cache_keyword(Older()) == "past_key_values"


def test_every_library_kernel_counts_as_zspeed():
    """Each ``def ..._kernel(`` of ``zspeed.kernels`` (but the attention kernel) is profiled as zspeed's, whatever
    its name: the kinds come from the sources, not a list that misses the next kernel."""
    bench = _bench()
    names = bench.zspeed_kernels()
    assert {"dense_mma_w4_fold_kernel", "w4_fragment_kernel", "stationary_gemv_kernel", "_qmm_kernel",
            "sparse_mma_w4_kernel", "stripe_wgmma_w4_kernel", "_slot_attention_kernel"} <= names
    assert {name: bench.kernel_kind(name) for name in names} == \
        {name: "attention" if "attention" in name else "zspeed" for name in names}
