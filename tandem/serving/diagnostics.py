"""Diagnostics a service turns on for benchmarks (the target's ``TANDEM_TARGET_DIAGNOSTICS``):
a watchdog for stretches in which a thread could not get the GIL."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

# Set (to anything) for benchmarks: the target service logs garbage collections and
# stretches without the GIL long enough to stall a step, and its admission bursts.
TARGET_ENV = "TANDEM_TARGET_DIAGNOSTICS"


def log_stalls(log: logging.Logger, min_ms: float = 15.0, tick_s: float = 0.002) -> threading.Event:
    """Logs (WARNING) every stretch of ``min_ms`` or more in which a watchdog thread, asking
    for the GIL every ``tick_s``, did not get it (another thread held it, in one long C call
    say, or the process was not scheduled), with where every other thread stood when it got
    it back: the line a long C call returned to. Setting the returned event stops it."""
    stop = threading.Event()

    def watch() -> None:
        me = threading.get_ident()
        names: dict[int | None, str] = {}
        while not stop.is_set():
            started = time.perf_counter()
            time.sleep(tick_s)
            ms = (time.perf_counter() - started - tick_s) * 1e3
            if ms < min_ms:
                continue
            if len(names) != threading.active_count():
                names = {t.ident: t.name for t in threading.enumerate()}
            where = []
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame, limit=4)
                calls = " < ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)
                )
                where.append(f"[{names.get(ident, ident)}] {calls}")
            log.warning("stall of %.1f ms; threads: %s", ms, " | ".join(where))

    threading.Thread(target=watch, name="stall-watch", daemon=True).start()
    return stop
