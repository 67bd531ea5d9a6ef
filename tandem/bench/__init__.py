"""``tandem bench``: latency and throughput of target-only decoding, speculation in process and
speculation through the services, against transformers' ``generate`` (docs/performance.md)."""
