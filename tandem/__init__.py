"""Tandem: speculative decoding served as cooperating draft, target and gateway services."""

__version__ = "0.1.0"
