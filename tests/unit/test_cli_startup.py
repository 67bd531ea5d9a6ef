"""The ``tandem`` command starts without loading torch: its options come from the config
dataclasses (``tandem.settings``), which import no model code, so ``tandem --help`` and the
``tandem serve`` supervisor stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # a child interpreter: this one has torch loaded already


def test_the_command_line_loads_no_torch() -> None:
    probe = "import sys, tandem.apps.cli; print(sorted(m for m in sys.modules if m == 'torch'))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "[]", proc.stdout
