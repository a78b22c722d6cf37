"""zcompress on bad input: clear `zcompress <cmd>: error:` lines (exit 2) instead of tracebacks, outputs that
never overwrite or half-write a folder, warnings when there is less text than asked for, and what export
and eval carry over."""
import json
import os
import stat

import pytest

from zspeed.compress import cli
from zspeed.compress.tiny import tiny_llama

WORDS = "the of and to in a is was for on that with as by his at from it an were which are this be also".split()


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _error(capsys, *argv):
    code, _, err = _run(capsys, *argv)
    last = err.strip().splitlines()[-1]  # after any loading progress bars
    assert code == 2 and last.startswith(f"zcompress {argv[0]}: error:"), err
    return last


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(60)) for i in range(20)))
    return path


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A Hugging Face folder of the tiny Llama (byte vocabulary, no tokenizer files)."""
    path = tmp_path_factory.mktemp("hf") / "tiny-hf"
    tiny_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def q8(tmp_path_factory, hf):
    out = tmp_path_factory.mktemp("q") / "q8"
    assert cli.main(["quantize", "--model", str(hf), "--bits", "8", "--out", str(out), "--no-progress"]) == 0
    return out


# -- 1. --out is never overwritten, and is written whole or not at all ---------------------------------------
def test_quantize_refuses_an_existing_output(tmp_path, hf, capsys):
    before = {f.name: f.read_bytes() for f in hf.iterdir()}
    err = _error(capsys, "quantize", "--model", hf, "--bits", 8, "--out", hf)
    assert "is a folder that is not empty" in err and "nothing is overwritten" in err
    assert {f.name: f.read_bytes() for f in hf.iterdir()} == before
    (tmp_path / "file").write_text("keep")
    assert "is a file" in _error(capsys, "sparsify", "--model", "tiny", "--out", tmp_path / "file")
    assert (tmp_path / "file").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    code = _run(capsys, "quantize", "--model", "tiny", "--bits", 8, "--out", tmp_path / "empty", "--no-progress")[0]
    assert code == 0
    assert (tmp_path / "empty" / "zspeed_compress.json").is_file()


def test_a_failed_write_leaves_no_folder(tmp_path, monkeypatch):
    def fail(model, directory, **_):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(cli, "save_compressed", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        cli.main(["quantize", "--model", "tiny", "--bits", "8", "--out", str(tmp_path / "q"), "--no-progress"])
    assert list(tmp_path.iterdir()) == []


# -- 2. errors, not tracebacks ---------------------------------------------------------------------------------
def _truncate(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        (dst / f.name).write_bytes(data[:len(data) // 2] if f.name == "model.safetensors" else data)
    return dst


def test_truncated_weights(tmp_path, hf, q8, capsys):
    assert "corrupt or truncated" in _error(capsys, "inspect", _truncate(q8, tmp_path / "tq"))
    err = _error(capsys, "quantize", "--model", _truncate(hf, tmp_path / "th"), "--bits", 8, "--out", tmp_path / "o")
    assert "model.safetensors is corrupt or truncated" in err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "tiny", "--data", "T", "--seq-len", "1"], "--seq-len 1 is invalid: use at least 2"),
    (["eval", "--model", "tiny", "--data", "T", "--seq-len", "0"], "--seq-len 0 is invalid"),
    (["eval", "--model", "tiny", "--data", "T", "--max-windows", "0"], "--max-windows 0 is invalid: use at least 1"),
    (["quantize", "--model", "tiny", "--method", "gptq", "--calib", "T", "--calib-seq-len", "0", "--out", "O"],
     "--calib-seq-len 0 is invalid"),
    (["quantize", "--model", "tiny", "--method", "gptq", "--calib", "T", "--calib-samples", "0", "--out", "O"],
     "--calib-samples 0 is invalid"),
])
def test_counts_are_validated(argv, message, tmp_path, text, capsys):
    argv = [str(text) if a == "T" else str(tmp_path / "o") if a == "O" else a for a in argv]
    assert message in _error(capsys, *argv)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_model_must_be_a_folder(name, tmp_path, hf, capsys):
    err = _error(capsys, "quantize", "--model", hf / name, "--bits", 8, "--out", tmp_path / "o")
    assert f"--model {hf / name} is a file; --model takes the model's folder" in err


def test_vocabulary_mismatch(tmp_path, q8, text, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    big = tmp_path / "big"
    model = tiny_llama()
    model.resize_token_embeddings(512)
    model.save_pretrained(big)
    err = _error(capsys, "eval", "--model", q8, "--baseline", big, "--data", text, "--seq-len", 32, "--no-progress")
    assert f"--baseline {big} has a vocabulary of 512 tokens but --model has 256" in err
    # a folder holding another model's tokenizer: ids beyond the embedding
    q = tmp_path / "q"
    q.mkdir()
    for f in q8.iterdir():
        (q / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer(models.WordLevel({w: 300 + i for i, w in enumerate(WORDS)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(q)
    err = _error(capsys, "eval", "--model", q, "--data", text, "--seq-len", 32, "--no-progress")
    assert "but the model's embedding has 256 rows" in err


# -- 3. the recorded source ------------------------------------------------------------------------------------
def test_source_is_recorded_absolute(tmp_path, hf, text, capsys, monkeypatch):
    monkeypatch.chdir(hf.parent)
    assert _run(capsys, "quantize", "--model", hf.name, "--bits", 8, "--out", tmp_path / "q", "--no-progress")[0] == 0
    meta_path = tmp_path / "q" / "zspeed_compress.json"
    meta = json.loads(meta_path.read_text())
    assert meta["extra"]["source"] == str(hf.resolve())
    monkeypatch.chdir(tmp_path)
    code, report, _ = _run(capsys, "eval", "--model", "q", "--data", text, "--seq-len", 32, "--no-progress")
    assert code == 0 and "before" in report
    meta["extra"]["source"] = "gone-llama"
    meta_path.write_text(json.dumps(meta))
    err = _error(capsys, "eval", "--model", "q", "--data", text, "--seq-len", 32)
    assert "'gone-llama' not found: it is the source model recorded at compression time" in err
    assert "--baseline DIR" in err


# -- 4. messages in the CLI's terms ----------------------------------------------------------------------------
def test_messages_name_flags_and_files(tmp_path, q8, text, capsys):
    odd = tmp_path / "odd"
    tiny_llama(hidden=96, ffn=192).save_pretrained(odd)
    err = _error(capsys, "quantize", "--model", odd, "--group-size", 64, "--out", tmp_path / "o")
    assert "--pad-groups" in err and "--exclude" in err
    err = _error(capsys, "quantize", "--model", q8, "--bits", 8, "--out", tmp_path / "o")
    assert "is already compressed (zspeed_compress.json); quantize the original model" in err
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    err = _error(capsys, "eval", "--model", "tiny", "--data", tmp_path / "bad.jsonl")
    assert f"{tmp_path / 'bad.jsonl'}, line 2 is not valid JSON" in err
    (tmp_path / "short.txt").write_text("too short")
    err = _error(capsys, "eval", "--model", "tiny", "--data", tmp_path / "short.txt")
    assert "fewer than one window of --seq-len 512" in err
    (tmp_path / "nometa").mkdir()
    (tmp_path / "nometa" / "model.safetensors").write_bytes((q8 / "model.safetensors").read_bytes())
    err = _error(capsys, "eval", "--model", tmp_path / "nometa", "--data", text)
    assert "is not a zcompress output: no zspeed_compress.json" in err


# -- 5. fewer windows than asked -------------------------------------------------------------------------------
def test_few_calibration_windows_warn_and_are_recorded(tmp_path, text, capsys):
    out = tmp_path / "g"
    code, _, err = _run(capsys, "quantize", "--model", "tiny", "--method", "gptq", "--group-size", 32, "--calib",
                        text, "--calib-seq-len", 1024, "--out", out, "--no-progress")
    windows = len(text.read_bytes()) // 1024
    assert code == 0 and f"warning: {text} holds only {windows} windows of 1024 tokens, fewer than " \
                          "--calib-samples 32" in err
    assert json.loads((out / "zspeed_compress.json").read_text())["extra"]["calib_windows"] == windows
    code, _, err = _run(capsys, "eval", "--model", "tiny", "--data", text, "--seq-len", 1024, "--no-progress")
    assert code == 0 and "fewer than --max-windows 16" in err


# -- 6. options that would be ignored are refused --------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--bits", "8", "--group-size", "64"], "--group-size does not apply to --bits 8"),
    (["--bits", "8", "--symmetric"], "--symmetric does not apply to --bits 8"),
    (["--act-order", "--true-sequential"], "--act-order --true-sequential do not apply to --method rtn"),
    (["--fp-targets"], "--fp-targets does not apply to --method rtn"),
    (["--blocksize", "128"], "--blocksize does not apply to --method rtn"),
])
def test_options_that_do_not_apply_are_refused(argv, message, tmp_path, capsys):
    assert message in _error(capsys, "quantize", "--model", "tiny", *argv, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "0"], "group_size=0 is invalid"),
    (["--method", "gptq", "--damp", "0"], "damp=0.0 is invalid"),
])
def test_a_zero_given_is_refused_not_taken_for_the_default(argv, message, tmp_path, text, capsys):
    assert message in _error(capsys, "quantize", "--model", "tiny", *argv, "--calib", text, "--out", tmp_path / "o")


# -- 7. export -------------------------------------------------------------------------------------------------
def test_export_carries_tokenizer_files_and_what_was_run(tmp_path, text, capsys):
    old = os.umask(0o022)
    try:
        q = tmp_path / "q"
        assert _run(capsys, "quantize", "--model", "tiny", "--group-size", 32, "--method", "gptq", "--calib", text,
                    "--calib-seq-len", 64, "--true-sequential", "--out", q, "--no-progress")[0] == 0
        (q / "chat_template.jinja").write_text("{{ messages }}")
        assert stat.S_IMODE(q.stat().st_mode) == 0o755
        for seq in (True, False):
            if not seq:
                meta = json.loads((q / "zspeed_compress.json").read_text())
                meta["method"]["true_sequential"] = False
                (q / "zspeed_compress.json").write_text(json.dumps(meta))
            out = tmp_path / f"x{seq}"
            assert _run(capsys, "export", "--model", q, "--out", out)[0] == 0
            assert json.loads((out / "config.json").read_text())["quantization_config"]["true_sequential"] is seq
            assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
            assert stat.S_IMODE(out.stat().st_mode) == 0o755
    finally:
        os.umask(old)


# -- 8. eval shows progress ------------------------------------------------------------------------------------
def test_eval_progress_bar(text, capsys):
    code, _, err = _run(capsys, "eval", "--model", "tiny", "--data", text, "--seq-len", 64, "--max-windows", 2)
    assert code == 0 and "perplexity" in err and "2/2" in err
