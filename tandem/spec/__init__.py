"""Speculative decoding: trees, drafters, verification (docs/design.md section 3)."""
