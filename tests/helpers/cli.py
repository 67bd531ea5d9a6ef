"""``tandem`` as a user runs it: ``python -m tandem ARGS`` in a subprocess (warnings only in its
log)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TANDEM_LOG_LEVEL": "WARNING"}
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
