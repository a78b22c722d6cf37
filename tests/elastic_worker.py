"""ztrain under torchrun, with a fault: on the first attempt rank 1 dies before a given step (tests/test_elastic.py).

``ZSPEED_TEST_KILL_AT_STEP=k`` and ``ZSPEED_TEST_KILL_MARKER=path``: rank 1 writes the marker and leaves
with ``os._exit`` just before optimizer step k; a restarted attempt sees the marker and runs normally.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from zspeed.train import cli, trainer


def install_fault() -> None:
    step = int(os.environ.get("ZSPEED_TEST_KILL_AT_STEP", "0"))
    marker = Path(os.environ.get("ZSPEED_TEST_KILL_MARKER", "/nonexistent/marker"))
    if not step or os.environ.get("RANK") != "1" or marker.exists():
        return
    original = trainer._Loop._train_step

    def train_step(self, micro_batches):
        if self.engine.global_steps + 1 == step:
            marker.write_text("killed\n")
            os._exit(17)  # no cleanup, as a crashed worker
        return original(self, micro_batches)
    trainer._Loop._train_step = train_step


if __name__ == "__main__":
    install_fault()
    sys.exit(cli.main())
