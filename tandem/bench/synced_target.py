"""``python -m tandem.bench.synced_target``: the target service for benchmarks, its forward
followed by a device synchronisation so that StepStats.verify_ns is the forward's GPU time
(``tandem.bench.inprocess.synced_forward``; a no-op on CPU), except in steps decoding ahead
(``tandem.ahead``), which nothing may wait for. Garbage collections of 2 ms or more are logged,
so that a slow step in StepStats can be told from a collection. Flags as
``python -m target_service``."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import torch

import target_service.__main__ as target_main
from tandem import serving
from tandem.runner import ModelInputs, ModelRunner

logger = logging.getLogger("tandem.bench.synced_target")


def _synced(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(self: ModelRunner, inputs: ModelInputs, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, inputs, *args, **kwargs)
        if str(self.device).startswith("cuda") and not inputs.ahead:
            torch.cuda.synchronize(self.device)
        return out

    return run


if __name__ == "__main__":
    serving.log_gc_pauses(logger)
    ModelRunner.forward = _synced(ModelRunner.forward)  # type: ignore[method-assign]
    asyncio.run(target_main.main(target_main.parse_args()))
