"""Speculative decoding: trees, drafters, verification (DESIGN.md section 3)."""
