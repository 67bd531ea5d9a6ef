"""Deployment command lines (compose.yaml, deploy/k8s) checked against the parsers of the
modules they run: ``python -m MODULE FLAGS``, every flag spelled out in full (no abbreviation
argparse would accept) and the whole line accepted."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from draft_service.__main__ import build_parser as draft
    from gateway.__main__ import build_parser as gateway
    from tandem.serving.health_probe import build_parser as probe
    from target_service.__main__ import build_parser as target

    return {
        "draft_service": draft,
        "target_service": target,
        "gateway": gateway,
        "tandem.serving.health_probe": probe,
    }


def parse_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """The module ``argv`` runs and its parsed flags."""
    assert argv[:2] == ["python", "-m"], argv
    module, args = argv[2], argv[3:]
    parser = parsers()[module]()
    known = {s for action in parser._actions for s in action.option_strings}
    for arg in args:
        if arg.startswith("--"):
            assert arg.split("=")[0] in known, f"{module} has no flag {arg}"
    return module, parser.parse_args(args)
