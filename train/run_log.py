"""What a ``ztrain`` run leaves behind for people: a JSONL log and a loss-curve PNG.

The log (``<out>/log.jsonl``) is one JSON object per line, appended (a resumed
run continues the same file), each with an ``"event"``:

* ``"start"``: the resolved config, data counts, model and world size;
* ``"train"``: ``step``, ``epoch``, ``loss`` (mean over the step's micro-batches
  on all ranks), ``lr``, ``tokens_per_s`` (all ranks), ``memory_bytes`` (peak:
  device memory on CUDA, resident set on the CPU), ``elapsed_s``;
* ``"eval"``: ``step``, ``eval_loss`` (token-weighted mean over the held-out rows);
* ``"checkpoint"``, ``"export"``, ``"end"``.

:func:`plot_losses` draws train and eval loss against the step from the log;
when a resumed run repeats steps, the last record of each step wins.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "read_log", "plot_losses"]


class RunLog:
    """Appends events to a JSONL file (only on the rank that owns it)."""

    def __init__(self, path: str | os.PathLike, *, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._start = time.perf_counter()

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"event": event, "time": round(time.time(), 3),
                  "elapsed_s": round(time.perf_counter() - self._start, 3), **fields}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a log (a torn last line, from a killed run, is skipped)."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _series(records: list[dict[str, Any]], event: str, key: str) -> tuple[list[int], list[float]]:
    by_step: dict[int, float] = {}
    for r in records:
        if r.get("event") == event and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            by_step[int(r["step"])] = float(r[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_losses(log_path: str | os.PathLike, png_path: str | os.PathLike, *, title: str = "ztrain") -> Path:
    """Draw train loss (and eval loss, when logged) against the optimizer step; return the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    train_x, train_y = _series(records, "train", "loss")
    eval_x, eval_y = _series(records, "eval", "eval_loss")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train_x:
        ax.plot(train_x, train_y, lw=1.0, alpha=0.8, label="train loss")
    if eval_x:
        ax.plot(eval_x, eval_y, marker="o", lw=1.5, label="eval loss (held out)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train_x or eval_x:
        ax.legend()
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out)
    plt.close(fig)
    return out
