"""Random models and drafts for tests and benchmarks."""
