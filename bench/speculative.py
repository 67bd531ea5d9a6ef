"""Script twin of ``tandem bench`` (same flags; ``--help``), for machines where the console
script is not installed: ``PYTHONPATH=. python bench/speculative.py --preset tiny``.

Target-only decoding, speculation in process and through the three services, transformers'
generate and assisted generation, at several batch sizes (docs/performance.md)."""

from __future__ import annotations

import logging

import typer

from tandem.bench.cli import bench

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Each device-chain run's start and end (why it ended), between the rows' progress lines.
    logging.getLogger("tandem.target.device_chain").setLevel(logging.DEBUG)
    typer.run(bench)
