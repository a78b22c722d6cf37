"""The zcompress CLI on the built-in tiny Llama: every subcommand, and its error messages."""
import re

import pytest

from zspeed.compress.cli import main


WORDS = "the of and to in a is was for on that with as by his at from it an were which are this be also".split()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(60))
                                for i in range(80)))
    return path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_quantize_inspect_eval(tmp_path, text_file, capsys):
    out = tmp_path / "q"
    code, stdout, _ = _run(capsys, "quantize", "--model", "tiny", "--bits", 4, "--group-size", 32, "--method",
                           "gptq", "--calib", text_file, "--calib-samples", 4, "--calib-seq-len", 64, "--out", out,
                           "--act-order", "--true-sequential", "--fp-targets", "--no-progress")
    assert code == 0 and "14 modules compressed" in stdout
    code, table, _ = _run(capsys, "inspect", out)
    assert code == 0
    row = next(line for line in table.splitlines() if line.startswith("model.layers.0.mlp.up_proj"))
    assert "int4 g32" in row
    total = next(line for line in table.splitlines() if line.startswith("total (14 modules)"))
    assert float(total.split()[-1]) > 5.0  # fp32 → int4 g32: ~6.7x smaller
    code, report, _ = _run(capsys, "eval", "--model", out, "--data", text_file, "--seq-len", 64, "--max-windows", 4)
    assert code == 0
    before, after = (float(re.search(rf"^{k}\s+([\d.]+)", report, re.M).group(1)) for k in ("before", "after"))
    assert abs(after / before - 1) < 0.05


def test_sparsify_with_int4(tmp_path, text_file, capsys):
    out = tmp_path / "s"
    code, _, err = _run(capsys, "sparsify", "--model", "tiny", "--pattern", "2:4", "--method", "wanda", "--int4",
                        "--group-size", 64, "--calib", text_file, "--calib-samples", 2, "--calib-seq-len", 64,
                        "--out", out, "--no-progress")
    assert code == 0, err
    code, table, _ = _run(capsys, "inspect", out)
    assert "sparse2:4+int4 g64" in table


@pytest.mark.parametrize("argv, message", [
    (["quantize", "--model", "tiny", "--method", "gptq", "--out", "X"], "needs calibration text: pass --calib"),
    (["quantize", "--model", "tiny", "--method", "awq", "--out", "X"], "unknown method 'awq' for quantize"),
    (["quantize", "--model", "tiny", "--group-size", "48", "--out", "X"], "group_size=48 is invalid"),
    (["quantize", "--model", "no/such/dir", "--out", "X"], "model 'no/such/dir' not found"),
    (["sparsify", "--model", "tiny", "--pattern", "2/4", "--out", "X"], "is not N:M"),
    (["sparsify", "--model", "tiny", "--pattern", "4:4", "--out", "X"], "MagnitudeConfig.n=4 is invalid"),
    (["inspect", "no/such/dir"], "no/such/dir does not exist"),
])
def test_bad_inputs_exit_2_with_a_message(argv, message, capsys):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err and err.startswith(f"zcompress {argv[0]}: error:")
