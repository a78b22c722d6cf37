"""`zspeed-demo`: the whole pipeline on the CPU, end to end, with nothing downloaded at run time.

1. core: stream a layered model from disk, shard / gather / reduce-scatter on 2 gloo processes;
2. ztrain: a tiny Llama on real English text (Wikipedia paragraphs from an installed package),
   2 processes, ZeRO-2, with the held-out loss logged and plotted;
3. zcompress: the trained model to INT8;
4. zserve: serve it over gRPC on 127.0.0.1, query it, and stop it with SIGTERM (drain, exit 0).

Each stage runs the real command-line tool in a subprocess; outputs land in ``--out`` (runs/demo).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _run(title: str, args: list[str]) -> None:
    print(f"\n== {title}\n$ {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", *args], check=True)
    print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eval_losses(log: Path) -> list[float]:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r["eval_loss"] for r in rows if r.get("event") == "eval"]


def _wait_for_server(port: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"zserve exited early with code {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise SystemExit(f"zserve did not listen on port {port} within {timeout:.0f} s")


def serve_and_query(model_dir: Path, prompt: str) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "zspeed.serve.cli", "--model", str(model_dir), "--offload", "cpu",
           "--port", str(port), "--no-progress"]
    print(f"\n== zserve: INT8 model over gRPC, weights streamed from pinned CPU memory\n$ {' '.join(cmd[2:])}",
          flush=True)
    server = subprocess.Popen(cmd)
    try:
        _wait_for_server(port, server)
        _run("zserve query", ["zspeed.serve.cli", "query", "--port", str(port), prompt, "--max-new-tokens", "24"])
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    print(f"   zserve drained and exited with code {code} after SIGTERM", flush=True)
    if code != 0:
        raise SystemExit(f"zserve exited with code {code}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="zspeed-demo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/demo", help="where the stages write (default runs/demo)")
    ap.add_argument("--steps", type=int, default=150, help="ztrain optimizer steps (default 150)")
    ap.add_argument("--skip-core", action="store_true", help="skip the core streaming/sharding check")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    t0 = time.perf_counter()
    if not args.skip_core:
        _run("core: streamer and sharded collectives", ["zspeed.core.demo"])
    train_dir, int8_dir = out / "train", out / "int8"
    for stage in (train_dir, int8_dir):  # a previous demo's outputs: ztrain and zcompress refuse to overwrite them
        if stage.exists():
            print(f"   replacing the previous demo's {stage}", flush=True)
            shutil.rmtree(stage)
    _run("ztrain: tiny Llama, real English text, 2 processes, ZeRO-2",
         ["zspeed.train.cli", "--model", "tiny-llama", "--demo-corpus", "2000", "--nproc", "2", "--zero-stage", "2",
          "--seq-len", "128", "--micro-batch", "8", "--max-steps", str(args.steps), "--lr", "2e-3",
          "--out", str(train_dir)])
    evals = _eval_losses(train_dir / "log.jsonl")
    if len(evals) >= 2:
        print(f"   held-out loss {evals[0]:.3f} -> {evals[-1]:.3f} (curve: {train_dir / 'loss.png'})")
    if len(evals) < 2 or not evals[-1] < evals[0]:
        raise SystemExit(f"the held-out loss did not fall: {evals}")
    _run("zcompress: INT8 weight-only", ["zspeed.compress.cli", "quantize", "--model", str(train_dir / "model"),
                                         "--bits", "8", "--out", str(int8_dir)])
    serve_and_query(int8_dir, "The history of")
    print(f"\nzspeed-demo finished in {time.perf_counter() - t0:.0f} s: OK")


if __name__ == "__main__":
    main()
