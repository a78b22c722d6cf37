"""Run a function on several gloo processes on the CPU and collect what each returns."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)
    from zspeed.core.topology import Topology, TopologyConfig
    topo = Topology.from_env(TopologyConfig(backend="gloo", device="cpu", timeout_s=120))
    try:
        queue.put((rank, "ok", fn(topo, *args)))
    except BaseException:  # report every failure to the parent, then leave
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        topo.shutdown()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(topo, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be a module-level function (processes are spawned). A failure on
    any rank raises AssertionError carrying that rank's traceback; a hang fails
    after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
