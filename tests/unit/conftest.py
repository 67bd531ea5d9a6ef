"""Fixtures of the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import ARCHS, make_checkpoint


@pytest.fixture(scope="module", params=ARCHS)
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tokenizer=False)
