"""tandem.serving.diagnostics.log_stalls: a thread holding the GIL in one long C call is reported,
with the line it returned to."""

from __future__ import annotations

import logging
import time

import pytest

from tandem.serving import diagnostics as stalls


def test_a_long_c_call_is_logged_where_it_returned(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("tandem.test.stalls")
    stop = stalls.log_stalls(log, min_ms=15.0)
    try:
        time.sleep(0.05)  # the watchdog is ticking
        with caplog.at_level(logging.WARNING, logger=log.name):
            started = time.perf_counter()
            total = sum(range(30_000_000))  # one C call: the GIL is not given up inside it
            held_ms = (time.perf_counter() - started) * 1e3
            time.sleep(0.05)  # the watchdog gets the GIL and logs
    finally:
        stop.set()
    assert total > 0 and held_ms > 30
    lines = [r.getMessage() for r in caplog.records if "stall of" in r.getMessage()]
    assert lines, f"no stall logged for a {held_ms:.0f} ms hold"
    assert "test_a_long_c_call_is_logged_where_it_returned" in lines[-1]
