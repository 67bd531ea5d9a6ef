"""Fixtures of the deployment tests."""

from __future__ import annotations

import pytest

from tests.deploy.pki import PKI, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """Two CAs and the certificates the TLS tests need, as PEM files."""
    return make_pki(tmp_path_factory.mktemp("pki"))
