"""``zserve``: serve a model over gRPC, query a server, or write a random-weight checkpoint.

    zserve --model DIR|HF_ID|PRESET [--random-weights] --offload none|cpu|nvme [--nvme-path P] [--window K]
           [--fuse-projections auto|on|off]
           [--host 127.0.0.1] [--port 50051] [--metrics-port P] [--tls-cert F --tls-key F] [--auth-token T]
    zserve query [--host H] --port P [--wait S] [--stream] [--max-new-tokens N] "prompt"
    zserve synth --arch llama-70b --out DIR [--num-layers N]

The server drains on SIGTERM (or Ctrl-C): it stops taking requests, finishes
those it has, and exits 0; while it is still loading the model, it just exits 0.
``zserve query`` waits up to ``--wait`` seconds (default 60) for the server to
report SERVING, so it can follow ``zserve ... &`` at once. The bearer token can also come from the
``ZSERVE_AUTH_TOKEN`` environment variable (kept out of ``ps``).

[Note: GC freeze] Before the port opens, ``zserve`` collects once and then
freezes every live object (``gc.freeze``): torch, transformers and gRPC leave a
few hundred thousand long-lived objects behind, and each full collection of
Python's cyclic collector walked all of them with the GIL held, stopping the
engine thread and every RPC thread at once for 100-200 ms (measured on the
``tiny`` preset on a CPU: a 170 ms pause in the load test's burst of requests
halved its saturation rate; in a steady run such a pause lengthens one
inter-token gap of every running request by as much). Frozen objects are still
freed by reference counting; only cycles among them are never collected, and
they live as long as the server anyway. Full collections then walk only what
serving creates. At exit they are unfrozen again (an ``atexit`` handler), so
the interpreter's last collection frees them: left frozen, objects of extension
modules outlived the modules' teardown, and nanobind (Triton 3.9's bindings,
which torch imports) printed a page of "leaked instance" lines as each zserve
process exited, the end of ``zspeed-demo`` included.

[Note: GIL switch interval] With the engine in its own process, the gRPC
process is all waiting threads: the pipe reader that receives each step's
tokens and one thread per streaming call that sends them. A thread that wakes
while another holds the GIL waits for it to be given up, and a busy holder is
only asked to after ``sys.getswitchinterval()`` (5 ms by default): with a few
dozen streams a token can queue behind several such waits. On the H100 (session
5, Llama-8B, 0.8 of saturation) the engine's steps were even (period p99/p50
1.1) while the gaps the client saw had a p99/p50 of 1.6. The gRPC process
therefore asks for a hand-off every :data:`GIL_SWITCH_S` (0.5 ms): in the next
runs the client's p99/p50 was 1.16-1.21 at 0.8 of saturation, and saturation
stayed within run-to-run noise (0.94-0.99x offline; benchmarks/RESULTS.md,
serving, session 5). The engine process keeps the default: its step loop is
the one busy thread there.
"""
from __future__ import annotations

import argparse
import atexit
import errno
import gc
import logging
import os
import signal
import sys
import threading

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning, so on a
# CPU-only host the gRPC and engine threads are not starved of cores between
# operations (with spinning, a 2-core host served ~50x slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOKEN_ENV = "ZSERVE_AUTH_TOKEN"
_SUBCOMMANDS = ("serve", "query", "synth")
_EPILOG = """other commands:
  zserve query [--port P] [--wait S] "prompt"   send one prompt to a running server (zserve query -h)
  zserve synth --arch PRESET --out DIR          write a random-weight checkpoint (zserve synth -h)"""


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zserve", description="Serve a causal LM over gRPC (zspeed.serve.v1).",
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True, help="HF folder, zcompress folder, HF id in the local cache, or a "
                   "preset (tiny, llama-8b, llama-70b) with --random-weights")
    m.add_argument("--random-weights", action="store_true", help="serve random weights of a preset's shape")
    m.add_argument("--random-weights-dir", help="where to write them (default ~/.cache/zspeed/random/...)")
    m.add_argument("--num-layers", type=int, help="decoder layers of a preset (default: the preset's)")
    m.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                   help="where layer weights live: on the device, pinned CPU memory, or disk (streamed per step)")
    m.add_argument("--nvme-path", help="folder for --offload nvme layer files")
    m.add_argument("--window", type=int, default=2, help="device slots layers stream through (default 2)")
    m.add_argument("--dtype", default="auto", help="weights and activations dtype (default: the checkpoint's)")
    m.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda:N")
    m.add_argument("--fuse-projections", choices=("auto", "on", "off"), default="auto",
                   help="run each layer's q/k/v and gate/up projections as one matmul each (fewer kernel launches; "
                        "faster small-batch decode): auto (default) where the layers are resident (--offload none), "
                        "on: the same but an error with offload or where nothing can be fused, off: never")
    n = p.add_argument_group("network and security")
    n.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    n.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    n.add_argument("--metrics-host", default="127.0.0.1")
    n.add_argument("--metrics-port", type=int, help="Prometheus metrics port (0 picks one; default: none)")
    n.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key)")
    n.add_argument("--tls-key", help="PEM private key")
    n.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV),
                   help=f"require 'authorization: Bearer TOKEN' (default: ${TOKEN_ENV})")
    b = p.add_argument_group("batching and limits")
    b.add_argument("--max-batch-size", type=int, default=8)
    b.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    b.add_argument("--max-queue-size", type=int, default=64, help="waiting requests; beyond: RESOURCE_EXHAUSTED")
    b.add_argument("--max-queue-delay-ms", type=float, default=0.0, help="let a batch form for this long")
    b.add_argument("--max-prefill-tokens-per-step", type=int, default=96,
                   help="prompt tokens a step may feed while sequences decode (evens out inter-token gaps; "
                        "lifted while requests queue up); 0: no cap (default: 96)")
    b.add_argument("--prefill-pacing-steps", type=int, default=2,
                   help="under the cap, feed pending prompt tokens over about this many steps (chunks of at "
                        "least 32 tokens); 0: the whole cap (default: 2)")
    b.add_argument("--max-model-len", type=int, help="prompt + output tokens (default: model's, at most 4096)")
    b.add_argument("--max-prompt-tokens", type=int, help="default: max-model-len - 1")
    b.add_argument("--max-new-tokens", type=int, default=2048, help="cap on a request's max_new_tokens")
    b.add_argument("--default-max-new-tokens", type=int, default=64, help="when a request gives 0")
    b.add_argument("--max-message-bytes", type=int, default=4 << 20)
    b.add_argument("--drain-timeout", type=float, default=300.0, help="seconds SIGTERM waits for requests")
    b.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run resident decoder layers as CUDA graphs around attention (default: where supported)")
    b.add_argument("--attention-kernel", choices=("auto", "sdpa", "triton"), default="auto",
                   help="attention: one Triton kernel per layer over the KV cache (triton), or torch SDPA per "
                        "prompt chunk and over a gathered batch of decodes (sdpa); auto (default): triton on a "
                        "CUDA device when triton is installed and the head size is a power of two, else sdpa")
    b.add_argument("--step-log", help="append one JSON line per engine step to this file (for diagnosis)")
    b.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the model in a process of its own, apart from the gRPC threads (default: yes)")
    o = p.add_argument_group("output")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--log-level", default="INFO")
    return p


def _query_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zserve query", description="Send one prompt to a zserve server.")
    p.add_argument("prompt", nargs="?", help="the prompt text (or ids with --token-ids)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="wait this long for the server to be ready (e.g. still loading) before sending; 0: do "
                        "not wait (default 60)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default: ${TOKEN_ENV})")
    p.add_argument("--tls-ca", help="PEM file of the CA (or self-signed certificate) to trust; implies TLS")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--server-name", help="name to check the certificate against")
    p.add_argument("--token-ids", action="store_true", help="the prompt is token ids, e.g. '1 2 3'")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--show-tokens", action="store_true", help="also print the generated token ids")
    p.add_argument("--info", action="store_true", help="print the server's model info and exit")
    p.add_argument("--timeout", type=float, default=600.0)
    return p


def _synth_parser() -> argparse.ArgumentParser:
    from .presets import PRESETS

    p = argparse.ArgumentParser(prog="zserve synth", description="Write a random-weight checkpoint of a preset.")
    p.add_argument("--arch", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in _SUBCOMMANDS else "serve"
    prog = "zserve" if command == "serve" else f"zserve {command}"  # as argparse names it
    try:
        if command == "query":
            return cmd_query(_query_parser().parse_args(argv))
        if command == "synth":
            return cmd_synth(_synth_parser().parse_args(argv))
        return cmd_serve(_serve_parser().parse_args(argv))
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except StoppedWhileLoading:
        print(f"{prog}: stopped by a signal while loading the model; exiting", file=sys.stderr)
        return 0


class StoppedWhileLoading(BaseException):
    """SIGTERM or SIGINT arrived before the server started: nothing to drain, so it just exits 0."""


def _stop_loading(signum, frame) -> None:
    raise StoppedWhileLoading


def _interruptible(start):
    """``start()`` with SIGTERM and SIGINT raising :class:`StoppedWhileLoading`; the old handlers are back if it
    fails."""
    previous = {sig: signal.signal(sig, _stop_loading) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return start()
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise


def check_ranges(*checks: tuple[str, float | None, float, float]) -> None:
    """Raises ValueError naming the flag of the first ``(flag, value, low, high)`` with value outside [low, high]."""
    for flag, value, low, high in checks:
        if value is not None and not low <= value <= high:
            bounds = f">= {low:g}" if high == float("inf") else f"in [{low:g}, {high:g}]"
            raise ValueError(f"{flag} must be {bounds}, got {value:g}")


def check_port_free(host: str, port: int | None, flag: str) -> None:
    """Raises OSError naming ``flag`` if ``host:port`` cannot be bound (in use), before the model loads."""
    if not port:  # None: not served; 0: the OS picks a free one
        return
    import socket

    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            probe.bind(addr)
        except OSError as e:
            shown = f"[{host}]" if ":" in host else host
            raise OSError(f"{shown}:{port} is in use ({flag}); choose another port" if e.errno == errno.EADDRINUSE
                          else f"cannot bind {shown}:{port} ({flag}): {e.strerror}") from None


_ANY = float("inf")
_PORT = (0, 65535)


def cmd_serve(args: argparse.Namespace) -> int:
    check_ranges(("--port", args.port, *_PORT), ("--metrics-port", args.metrics_port, *_PORT),
                 ("--max-batch-size", args.max_batch_size, 1, _ANY),
                 ("--max-num-batched-tokens", args.max_num_batched_tokens, args.max_batch_size, _ANY),
                 ("--max-queue-size", args.max_queue_size, 1, _ANY),
                 ("--max-queue-delay-ms", args.max_queue_delay_ms, 0, _ANY),
                 ("--max-model-len", args.max_model_len, 2, _ANY),
                 ("--max-prompt-tokens", args.max_prompt_tokens, 1, _ANY),
                 ("--max-new-tokens", args.max_new_tokens, 1, _ANY),
                 ("--default-max-new-tokens", args.default_max_new_tokens, 1, args.max_new_tokens),
                 ("--max-message-bytes", args.max_message_bytes, 1024, _ANY),
                 ("--drain-timeout", args.drain_timeout, 0, _ANY),
                 ("--num-layers", args.num_layers, 1, _ANY), ("--window", args.window, 1, _ANY))
    if args.prefill_pacing_steps < 0:
        raise ValueError(f"--prefill-pacing-steps must be >= 0 (0: no pacing), got {args.prefill_pacing_steps}")
    if args.max_prefill_tokens_per_step < 0:
        raise ValueError("--max-prefill-tokens-per-step must be >= 0 (0: no cap), "
                         f"got {args.max_prefill_tokens_per_step}")
    # Until the server exists SIGTERM ends the process with exit 0 (nothing to drain; imports and
    # loading included); from then on it drains.
    stop = threading.Event()
    server = _interruptible(lambda: _start_server(args, stop))
    # The kernel may deliver SIGTERM to any thread; Python runs the handler on the main
    # thread only when it wakes, so wait in short slices rather than block for good.
    while not stop.wait(0.1):
        if not server.engine.alive:
            logging.getLogger("zspeed.serve").error("the engine stopped; shutting down")
            server.stop(grace=5.0)
            return 1
    return 0 if server.drain() else 1


def _start_server(args: argparse.Namespace, stop: threading.Event):
    """Loads the model and starts the server; SIGTERM and SIGINT set ``stop`` from before the port opens."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s zserve %(levelname)s %(message)s")
    from .model_loader import LoadConfig, load_model
    from .server import ServerConfig, create_server

    server_config = ServerConfig(
        host=args.host, port=args.port, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=args.auth_token or None,
        max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_size=args.max_queue_size, max_queue_delay_ms=args.max_queue_delay_ms,
        max_prefill_tokens_per_step=args.max_prefill_tokens_per_step or None,
        prefill_pacing_steps=args.prefill_pacing_steps or None, max_model_len=args.max_model_len,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, default_max_new_tokens=args.default_max_new_tokens,
        max_message_bytes=args.max_message_bytes, drain_timeout_s=args.drain_timeout, step_log=args.step_log,
        cuda_graphs=args.cuda_graphs, attention_kernel=args.attention_kernel,
    )
    load_config = LoadConfig(
        model=args.model, random_weights=args.random_weights, random_weights_dir=args.random_weights_dir,
        num_layers=args.num_layers, offload=args.offload, nvme_path=args.nvme_path, window=args.window,
        dtype=args.dtype, device=args.device, fuse_projections=args.fuse_projections, progress=not args.no_progress,
    )
    from zspeed.core.store_config import StoreError

    check_port_free(args.host, args.port, "--port")
    check_port_free(args.metrics_host, args.metrics_port, "--metrics-port")
    if args.engine_process:  # the model loads in the engine process (see [Note: engine process])
        from .server import create_process_server

        server = create_process_server(load_config, server_config)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
        sys.setswitchinterval(GIL_SWITCH_S)
        try:
            freeze_startup_objects()
            server.start()
        except BaseException:
            server.stop(grace=0)
            raise
    else:
        try:
            model = load_model(load_config)
        except StoreError as e:
            raise OSError(f"weight store: {e}") from None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
        try:
            server = create_server(model, server_config)
            freeze_startup_objects()
            server.start()
        except BaseException:
            model.close()
            raise
    return server


GIL_SWITCH_S = 0.0005  # the gRPC process's GIL hand-off interval ([Note: GIL switch interval])


def freeze_startup_objects() -> None:
    """Keeps what start-up left alive out of the cyclic collector's full passes until the interpreter exits (see
    [Note: GC freeze])."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    logging.getLogger("zspeed.serve").info("gc: %d start-up objects frozen", gc.get_freeze_count())


def cmd_query(args: argparse.Namespace) -> int:
    check_ranges(("--port", args.port, 1, 65535), ("--wait", args.wait, 0, _ANY),
                 ("--max-new-tokens", args.max_new_tokens, 0, _ANY), ("--timeout", args.timeout, 0.001, _ANY))
    import grpc

    from .client import Client

    try:
        return _query(args, Client)
    except grpc.RpcError as e:
        print(f"zserve query: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def _query(args: argparse.Namespace, Client) -> int:
    address = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    client = Client(address, token=args.token, tls=args.tls, root_certificates=args.tls_ca,
                    server_name=args.server_name, timeout=args.timeout)
    with client:
        if args.wait > 0:
            why = client.wait_ready(args.wait, on_wait=lambda _: print(
                f"zserve query: waiting up to {args.wait:g}s for the server at {address} ...", file=sys.stderr))
            if why is not None:
                print(f"zserve query: error: no server ready at {address} after {args.wait:g}s ({why}); start one "
                      "with 'zserve --model ...' or wait longer with --wait SECONDS", file=sys.stderr)
                return 1
        if args.info:
            print(client.model_info())
            return 0
        if args.prompt is None:
            raise ValueError("give a prompt (or --info)")
        prompt = [int(t) for t in args.prompt.replace(",", " ").split()] if args.token_ids else args.prompt
        options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, stop=args.stop)
        pieces = client.generate_stream(prompt, **options) if args.stream else [client.generate(prompt, **options)]
        tokens: list[int] = []
        for piece in pieces:
            tokens += piece.token_ids
            print(piece.text, end="", flush=True)
            last = piece
        print()
        if args.show_tokens:
            print(" ".join(map(str, tokens)))
        print(f"[{last.finish_reason}: {last.prompt_tokens} prompt + {last.completion_tokens} generated tokens]",
              file=sys.stderr)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    import torch

    from .presets import write_random_checkpoint

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype")
    out = write_random_checkpoint(args.arch, args.out, num_layers=args.num_layers, dtype=dtype, seed=args.seed)
    print(f"wrote a random {args.arch} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
