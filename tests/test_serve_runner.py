"""The model runner on the CPU against Hugging Face: loading, offload, batching, sampling, KV cache."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.serve_cases import NEW_TOKENS, PROMPTS, Reference, build_tiny_model, load_tiny
from zspeed.serve.attention import DecodeBatch, LayerAttention, Segment, chunk_mask, slot_attention
from zspeed.serve.checkpoint import CheckpointError
from zspeed.serve.engine_loop import EngineLoop
from zspeed.serve.kv_cache import KVCache, KVCacheConfig, KVCacheFullError
from zspeed.serve.model_loader import LoadConfig, Offload, load_model
from zspeed.serve.presets import preset_config, write_random_checkpoint
from zspeed.serve.request import Request, SamplingParams
from zspeed.serve.runner import ModelRunner
from zspeed.serve.sampling import sampling_probs, top_k_filter, top_p_filter
from zspeed.serve.scheduler import DecodeItem, PrefillChunk, Scheduler, SchedulerConfig, SchedulerOutput
from zspeed.serve.sequence import SequenceStatus
from zspeed.core.device import DeviceHandle


def make_engine(model, *, max_batch_size=4, budget=16, max_model_len=256,
                graphs=None) -> tuple[EngineLoop, ModelRunner]:
    runner = ModelRunner(model, max_batch_size=max_batch_size, max_model_len=max_model_len, graphs=graphs)
    config = SchedulerConfig(max_batch_size=max_batch_size, max_num_batched_tokens=budget, max_model_len=max_model_len,
                             eos_token_ids=frozenset(model.description.eos_token_ids))
    return EngineLoop(Scheduler(config, kv_capacity=runner.kv_capacity), runner), runner


def generate_all(engine: EngineLoop, prompts, *, max_new_tokens=NEW_TOKENS, **sampling):
    handles = [engine.submit(Request(request_id=f"r{i}", prompt_token_ids=p,
                                     sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling)))
               for i, p in enumerate(prompts)]
    return [h.result(timeout=120) for h in handles]


def test_one_request_matches_hf_generate(tiny_dir, reference):
    model = load_tiny(tiny_dir)
    engine, _ = make_engine(model)
    with engine:
        [result] = generate_all(engine, [PROMPTS[1]])
    assert result.status is SequenceStatus.FINISHED_LENGTH
    assert result.token_ids == reference.greedy(PROMPTS[1])


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_batched_requests_match_hf_generate(tiny_dir, reference, tmp_path, offload):
    """Six prompts of different lengths, four slots, a 16-token step budget (chunked prefill,
    prefill mixed with decodes, queueing): each sequence's greedy output equals HF's alone."""
    model = load_tiny(tiny_dir, offload=offload, nvme_path=str(tmp_path / "nvme"), window=2)
    engine, runner = make_engine(model, max_batch_size=4, budget=16)
    with engine:
        results = generate_all(engine, PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference.greedy(prompt), f"prompt of {len(prompt)} tokens"
    assert runner.cache.num_free == 4, "every finished sequence gave its KV slot back"
    if offload != "none":
        streamer = model.layers.streamer
        assert streamer.max_resident_seen <= 2
        assert streamer.stats.units_loaded > 3, "layers were streamed in again on every step"
        if offload == "nvme":
            assert len(list((tmp_path / "nvme").glob("*.ztensor"))) == 3 * 9
    runner.close()


def test_layers_split_around_attention_match_hf_generate(tiny_dir, reference, monkeypatch):
    """[Note: piecewise graphs], run eagerly on the CPU: steps padded to bucket sizes (chunked prefill
    mixed with decodes) give HF's greedy outputs; a step beyond the largest bucket runs the plain layers."""
    from zspeed.serve import piecewise

    model = load_tiny(tiny_dir)
    engine, runner = make_engine(model, max_batch_size=4, budget=16, graphs=True)
    assert runner._pieces is not None and not runner._pieces.capture
    runs = []
    monkeypatch.setattr(piecewise.PiecewiseLayers, "run", lambda self, h, *a, _run=piecewise.PiecewiseLayers.run:
                        runs.append(h.shape[1]) or _run(self, h, *a))
    with engine:
        results = generate_all(engine, PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference.greedy(prompt), f"prompt of {len(prompt)} tokens"
    assert runs and {runner._pieces.bucket(n) for n in runs} >= {4, 16}, "decode-only and mixed steps, padded"
    small = ModelRunner(model, max_batch_size=2, max_model_len=128, graphs=True)
    small._pieces.buckets = (1, 2, 4)  # a 37-token prompt is beyond: the plain layers run it
    runs.clear()
    sp = SamplingParams(max_new_tokens=3)
    first = small.step(SchedulerOutput(step=1, prefills=(PrefillChunk(0, tuple(PROMPTS[1]), 0, True, sp),)))
    second = small.step(SchedulerOutput(step=2, decodes=(DecodeItem(0, first.new_token_ids[0][0], 37, sp),)))
    tokens = [first.new_token_ids[0][0], second.new_token_ids[0][0]]
    assert runs == [1] and tokens == list(reference.greedy(PROMPTS[1], 2))


@pytest.mark.parametrize("graphs", [None, True], ids=["layers", "split"])
def test_triton_slot_attention_matches_hf_generate(tiny_dir, reference, monkeypatch, graphs):
    """attention_kernel="triton" ([Note: slot attention kernel], the Triton interpreter on a CPU): decodes and
    prompt chunks, batched, each layer's attention in one launch, give HF's greedy outputs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from zspeed.kernels import attention as kernel

    calls = []
    monkeypatch.setattr(kernel, "slot_attention",
                        lambda *a, _f=kernel.slot_attention, **k: calls.append(k["block_m"]) or _f(*a, **k))
    from zspeed.serve import step_graphs

    rows = []
    monkeypatch.setattr(step_graphs.StepGraphs, "run", lambda self, h, *a, _run=step_graphs.StepGraphs.run, **k:
                        rows.append(h.shape[1]) or _run(self, h, *a, **k))
    model = load_tiny(tiny_dir)
    runner = ModelRunner(model, max_batch_size=4, max_model_len=256, graphs=graphs, attention_kernel="triton")
    config = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=16, max_model_len=256,
                             eos_token_ids=frozenset(model.description.eos_token_ids))
    with EngineLoop(Scheduler(config, kv_capacity=runner.kv_capacity), runner) as engine:
        results = generate_all(engine, PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference.greedy(prompt), f"prompt of {len(prompt)} tokens"
    assert set(calls) == {1, kernel.BLOCK_M}, "decode-only steps and steps with prompt chunks"
    if graphs:  # [Note: whole-step graphs], run eagerly: padded rows write the scratch slot, never a sequence's
        assert runner._whole is not None and runner._pieces is None
        assert runner.cache.scratch_slot == 4 and runner.cache.keys.shape[1] == 5 and runner.cache.num_free == 4
        assert any(runner._whole.pieces.bucket(n) > n for n in rows), "some steps ran with padded rows"
        plain = KVCache(KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, slots=1, max_len=8),
                        device=DeviceHandle.for_device("cpu"))
        with pytest.raises(ValueError, match="scratch slot"):
            step_graphs.StepGraphs(runner._whole.pieces, plain, capture=False, max_batch_size=4)
        with pytest.raises(ValueError, match="a step of 2 rows needs 2 slots"):
            runner._whole.run(torch.zeros(1, 2, 64), (torch.zeros(1, 2, 16),) * 2, slots=[0], positions=[0, 1],
                              work=[], block_m=1)
    else:
        assert rows == []
    with pytest.raises(ValueError, match="attention_kernel"):
        ModelRunner(model, max_batch_size=1, max_model_len=64, attention_kernel="flash")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(model, max_batch_size=1, max_model_len=64, attention_kernel="triton")
    assert ModelRunner(model, max_batch_size=1, max_model_len=64).attention_kernel == "sdpa", "auto, no CUDA"
    assert runner.attention_kernel == "triton"
    from zspeed.serve import runner as runner_module

    monkeypatch.setattr(runner_module, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="needs the triton package"):
        ModelRunner(model, max_batch_size=1, max_model_len=64, attention_kernel="triton")


def test_layers_that_do_not_split_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="resident"):
        ModelRunner(load_tiny(tiny_dir, offload="cpu"), max_batch_size=1, max_model_len=64, graphs=True)
    assert ModelRunner(load_tiny(tiny_dir), max_batch_size=1, max_model_len=64)._pieces is None, "auto: CUDA only"


def test_eos_stops_like_hf(tiny_dir, reference):
    prompt = [200, 17]
    expected = reference.greedy(prompt, 40)
    assert len(expected) < 40 and expected[-1] == 2, "this prompt reaches EOS (token 2) in HF"
    engine, _ = make_engine(load_tiny(tiny_dir))
    with engine:
        [result] = generate_all(engine, [prompt], max_new_tokens=40)
        [ignoring] = generate_all(engine, [prompt], max_new_tokens=40, ignore_eos=True)
    assert result.status is SequenceStatus.FINISHED_STOPPED and result.token_ids == expected
    assert ignoring.token_ids == reference.greedy(prompt, 40, ignore_eos=True)


def test_nvme_store_is_reused_for_the_same_checkpoint(tiny_dir, reference, tmp_path, caplog):
    nvme = str(tmp_path / "nvme")
    load_tiny(tiny_dir, offload="nvme", nvme_path=nvme).close()
    with caplog.at_level(logging.INFO, logger="zspeed.serve"):
        model = load_tiny(tiny_dir, offload="nvme", nvme_path=nvme)
    assert "reusing the layer files" in caplog.text
    engine, _ = make_engine(model)
    with engine:
        [result] = generate_all(engine, [PROMPTS[3]])
    assert result.token_ids == reference.greedy(PROMPTS[3])
    model.close()


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_dir):
    engine, _ = make_engine(load_tiny(tiny_dir), max_batch_size=4, budget=64)
    params = dict(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    with engine:
        [alone] = generate_all(engine, [PROMPTS[0]], **params)
        batched = generate_all(engine, [PROMPTS[2], PROMPTS[0], PROMPTS[3]], **params)
        [other_seed] = generate_all(engine, [PROMPTS[0]], **{**params, "seed": 99})
        [top1] = generate_all(engine, [PROMPTS[0]], temperature=1.0, top_k=1, seed=5)
        [greedy] = generate_all(engine, [PROMPTS[0]])
    assert alone.token_ids == batched[1].token_ids
    assert other_seed.token_ids != alone.token_ids
    assert top1.token_ids == greedy.token_ids


def test_sampling_filters():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])
    assert torch.isinf(top_k_filter(logits, 2)).tolist() == [True, False, False, True, True]
    assert torch.equal(top_k_filter(logits, 0), logits)
    probs = logits.softmax(-1)  # sorted: idx1 .53, idx2 .20, idx0 .07 ...
    kept = ~torch.isinf(top_p_filter(logits, float(probs[1]) + 1e-4))
    assert kept.tolist() == [False, True, True, False, False], "the smallest set reaching p"
    assert (~torch.isinf(top_p_filter(logits, 0.01))).sum() == 1, "at least the most likely token"
    p = sampling_probs(logits, SamplingParams(temperature=0.5, top_k=3))
    expected = torch.zeros(5)
    expected[[0, 1, 2]] = (logits[[0, 1, 2]] / 0.5).softmax(-1)
    torch.testing.assert_close(p, expected)


def test_kv_cache_slots():
    cache = KVCache(KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, slots=2, max_len=8),
                    device=DeviceHandle.for_device("cpu"))
    a, b = cache.allocate(10), cache.allocate(11)
    assert a != b and cache.allocate(10) == a
    with pytest.raises(KVCacheFullError):
        cache.allocate(12)
    k = torch.randn(2, 3, 4)
    cache.write(1, b, 2, k, -k)
    keys, values = cache.read(1, b, 5)
    assert torch.equal(keys[:, 2:], k) and torch.equal(values[:, 2:], -k)
    with pytest.raises(KVCacheFullError):
        cache.write(0, a, 6, k, k)
    cache.free(10)
    cache.free(10)  # idempotent
    assert cache.allocate(12) == a
    assert cache.scratch_slot is None
    # a scratch slot ([Note: whole-step graphs]): allocated memory, never given to a sequence
    spare = KVCache(KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, slots=2, max_len=8, scratch_slots=1),
                    device=DeviceHandle.for_device("cpu"))
    assert spare.keys.shape[1] == 3 and spare.scratch_slot == 2 and spare.capacity_tokens == 16
    assert spare.config.nbytes == 2 * 3 * 8 * 4 * 4
    assert {spare.allocate(1), spare.allocate(2)} == {0, 1}
    with pytest.raises(KVCacheFullError):
        spare.allocate(3)
    with pytest.raises(ValueError, match="scratch_slots=2: must be 0 or 1"):
        KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, slots=2, max_len=8, scratch_slots=2)


def test_token_outside_vocabulary_fails_only_its_sequence(tiny_dir):
    runner = ModelRunner(load_tiny(tiny_dir), max_batch_size=2, max_model_len=64)
    sampling = SamplingParams()
    out = runner.step(SchedulerOutput(step=1, prefills=(PrefillChunk(0, (5, 6), 0, True, sampling),
                                                        PrefillChunk(1, (5, 999), 0, True, sampling))))
    assert set(out.new_token_ids) == {0} and "999" in out.failed[1]
    out = runner.step(SchedulerOutput(step=2, decodes=(DecodeItem(0, out.new_token_ids[0][0], 2, sampling),)))
    assert set(out.new_token_ids) == {0}


def test_random_preset_checkpoint(tmp_path):
    """``write_random_checkpoint`` writes one shard per layer; HF loads it; the server's output equals HF's."""
    from transformers import LlamaForCausalLM

    out = write_random_checkpoint("tiny", tmp_path / "rand", num_layers=2, dtype=torch.float32, progress=False)
    assert len(list(out.glob("model-*.safetensors"))) == 3
    hf = Reference(LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    model = load_model(LoadConfig(model="tiny", random_weights=True, random_weights_dir=str(out), num_layers=2,
                                  dtype="float32", device="cpu", progress=False))
    assert model.description.num_layers == 2 and model.tokenizer.name == "bytes"
    engine, _ = make_engine(model)
    with engine:
        results = generate_all(engine, PROMPTS[:3])
    assert [r.token_ids for r in results] == [hf.greedy(p) for p in PROMPTS[:3]]
    assert preset_config("llama-70b").num_hidden_layers == 80


def test_int8_zcompress_folder_matches_the_quantized_model(tiny_dir, tmp_path):
    """INT8 weights served (resident, resident split around attention as for CUDA graphs, and streamed as
    int8 bytes) equal the quantized model run directly."""
    from zspeed.compress import RTNConfig, load_compressed, quantize_model, save_compressed

    model = build_tiny_model()
    quantize_model(model, RTNConfig(bits=8), progress=False)
    save_compressed(model, tmp_path / "int8")
    quantized = Reference(load_compressed(tmp_path / "int8"))
    for offload, graphs in (("none", None), ("none", True), ("cpu", None)):
        served = load_tiny(tmp_path / "int8", offload=offload)
        assert served.description.quantization == "int8"
        if offload == "cpu":
            assert served.layers.store.meta("model.layers.0.mlp.up_proj.qweight").dtype == torch.int8
        engine, runner = make_engine(served, graphs=graphs)
        assert (runner._pieces is not None) == bool(graphs)
        with engine:
            results = generate_all(engine, PROMPTS[:4])
        assert [r.token_ids for r in results] == [quantized.greedy(p) for p in PROMPTS[:4]], offload
        served.close()


def test_hf_id_from_the_local_cache(tiny_dir, reference, tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abc"
    shutil.copytree(tiny_dir, snapshot)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = load_tiny("acme/tiny")
    assert model.description.source == str(snapshot)
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        load_tiny("acme/absent")


def test_load_errors(tmp_path, tiny_dir):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_dir / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        load_tiny(pickled)
    with pytest.raises(ValueError, match="random_weights"):
        LoadConfig(model="llama-8b")
    with pytest.raises(ValueError, match="nvme_path"):
        LoadConfig(model=str(tiny_dir), offload=Offload.NVME)
    with pytest.raises(CheckpointError, match="no such folder"):
        load_tiny(tmp_path / "absent")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_tiny(corrupt)
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_dir, other)
    (other / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not served"):
        load_tiny(other)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_other_llama_family_shapes_match_hf(arch, tmp_path):
    """Mistral (sliding-window config) and Qwen2 (biased q/k/v projections) run through the same runner."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    config = MistralConfig(**shape, sliding_window=128) if arch == "mistral" else Qwen2Config(**shape)
    cls = MistralForCausalLM if arch == "mistral" else Qwen2ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(1)
        hf_model = cls(config).eval()
    hf_model.save_pretrained(tmp_path / arch)
    model = load_tiny(tmp_path / arch, offload="cpu")
    assert model.description.architecture == arch
    engine, runner = make_engine(model, max_model_len=128)
    with engine:
        results = generate_all(engine, PROMPTS[:3], ignore_eos=True)
    expected = [Reference(hf_model).greedy(p, ignore_eos=True) for p in PROMPTS[:3]]
    assert [r.token_ids for r in results] == expected
    engine, runner = make_engine(load_tiny(tmp_path / arch), max_model_len=128, graphs=True)  # split layers
    with engine:
        assert [r.token_ids for r in generate_all(engine, PROMPTS[:3], ignore_eos=True)] == expected
    if arch == "mistral":
        with pytest.raises(ValueError, match="sliding window"):
            ModelRunner(model, max_batch_size=1, max_model_len=256)
    model.close()


def test_nf4_zcompress_folder_matches_the_quantized_model(tiny_dir, tmp_path):
    """NF4 weights (bitsandbytes' layout) served from a zcompress folder equal the NF4 model run directly."""
    from zspeed.compress import NF4Config, load_compressed, quantize_model, save_compressed

    model = build_tiny_model()
    quantize_model(model, NF4Config(blocksize=32), progress=False)
    save_compressed(model, tmp_path / "nf4")
    quantized = Reference(load_compressed(tmp_path / "nf4"))
    served = load_tiny(tmp_path / "nf4", offload="cpu")
    assert served.description.quantization == "nf4"
    engine, _ = make_engine(served)
    with engine:
        results = generate_all(engine, PROMPTS[:3])
    assert [r.token_ids for r in results] == [quantized.greedy(p) for p in PROMPTS[:3]]
    served.close()


def slot_attention_reference(query, key, value, cache, layer, segments, token_slots, token_positions):
    """The per-sequence attention that the batched decode path replaced: one SDPA call per segment."""
    cache.write_tokens(layer, token_slots, token_positions, key[0], value[0])
    outs = []
    for seg in segments:
        k, v = cache.read(layer, seg.slot, seg.kv_length)
        mask = chunk_mask(seg, query.device)
        o = F.scaled_dot_product_attention(query[:, :, seg.rows], k[None], v[None], attn_mask=mask,
                                           is_causal=seg.length > 1 and mask is None,
                                           enable_gqa=query.shape[1] != key.shape[1])
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


def packed_step(spans: list[tuple[int, int, int]]) -> tuple[tuple[Segment, ...], torch.Tensor, torch.Tensor]:
    """Segments of ``(slot, start, length)`` packed in order, with each token's slot and position."""
    segments, slots, positions, offset = [], [], [], 0
    for slot, start, length in spans:
        segments.append(Segment(slot=slot, start=start, length=length, offset=offset))
        slots += [slot] * length
        positions += range(start, start + length)
        offset += length
    return tuple(segments), torch.tensor(slots), torch.tensor(positions)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("spans", [
    # a chunk after a cached prefix, a one-token prompt between prompts, then decodes of different lengths
    [(0, 5, 3), (6, 0, 1), (1, 0, 4), (3, 6, 1), (4, 1, 1), (5, 11, 1), (2, 0, 1)],
    [(3, 6, 1), (4, 1, 1), (5, 11, 1)],  # decodes only
    [(5, 9, 1)],  # one decode: no padding, no mask
    [(0, 0, 7), (1, 3, 2)],  # prompts only
], ids=["mixed", "decodes", "one-decode", "prompts"])
def test_batched_decode_attention_matches_per_sequence(spans, heads):
    """One-token segments attend in one masked call; each gets its per-sequence numbers, in its own rows.
    The cache's unwritten entries are NaN: a padded position that leaked into the softmax would show."""
    num_heads, num_kv_heads = heads
    config = KVCacheConfig(num_layers=2, num_kv_heads=num_kv_heads, head_dim=8, slots=7, max_len=16)
    cpu = DeviceHandle.for_device("cpu")
    batched, reference = KVCache(config, device=cpu), KVCache(config, device=cpu)
    gen = torch.Generator().manual_seed(0)
    for cache in (batched, reference):
        cache.keys.fill_(float("nan"))
        cache.values.fill_(float("nan"))
    for slot, start, _ in spans:  # the cached prefixes
        k, v = torch.randn(2, num_kv_heads, start, 8, generator=gen)
        for cache in (batched, reference):
            cache.write(1, slot, 0, k, v)
    segments, token_slots, token_positions = packed_step(spans)
    n = len(token_slots)
    query = torch.randn(1, num_heads, n, 8, generator=gen)
    key, value = torch.randn(2, 1, num_kv_heads, n, 8, generator=gen)

    decodes = tuple(seg for seg in segments if seg.length == 1)
    decode = DecodeBatch.build(decodes, torch.tensor(DecodeBatch.host_values(decodes))) if decodes else None
    assert decode is None or (decode.mask is None) == (len({seg.kv_length for seg in decodes}) == 1)
    chunks = tuple(seg for seg in segments if seg.length > 1)
    out, _ = slot_attention(None, query, key, value, None, scaling=8 ** -0.5, sliding_window=16,
                            zspeed=LayerAttention(batched, 1, chunks, token_slots, token_positions, decode))
    expected = slot_attention_reference(query, key, value, reference, 1, segments, token_slots, token_positions)
    assert out.shape == (1, n, num_heads, 8) and out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(batched.keys.nan_to_num(), reference.keys.nan_to_num()), "the same KV writes"
    with pytest.raises(NotImplementedError, match="sliding window"):
        slot_attention(None, query, key, value, None, sliding_window=max(seg.kv_length for seg in segments) - 1,
                       zspeed=LayerAttention(batched, 1, chunks, token_slots, token_positions, decode))


def test_decode_step_calls_attention_once_per_layer(tiny_dir, monkeypatch):
    """A step of decodes only runs one SDPA call per layer, whatever the number of sequences."""
    runner = ModelRunner(load_tiny(tiny_dir), max_batch_size=3, max_model_len=64)
    sampling = SamplingParams()
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    out = runner.step(SchedulerOutput(step=1, prefills=tuple(PrefillChunk(i, tuple(p), 0, True, sampling)
                                                             for i, p in enumerate(prompts))))
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    decodes = tuple(DecodeItem(i, out.new_token_ids[i][0], len(p), sampling) for i, p in enumerate(prompts))
    assert set(runner.step(SchedulerOutput(step=2, decodes=decodes)).new_token_ids) == {0, 1, 2}
    assert len(calls) == runner.model.description.num_layers


def test_attention_never_runs_on_cudnn(tiny_dir, monkeypatch):
    """cuDNN's SDPA plans per shape (5.9 ms of host time a call on an H100, every step a new key length):
    the runner turns it off for its attention calls only, and leaves the process's setting as it was."""
    runner = ModelRunner(load_tiny(tiny_dir), max_batch_size=1, max_model_len=64)
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*a, **kw))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    runner.step(SchedulerOutput(step=1, prefills=(PrefillChunk(0, tuple(PROMPTS[0]), 0, True, SamplingParams()),)))
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
