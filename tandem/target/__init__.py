"""The verifier engine: ``Engine.step`` and its step modes, the scheduler, the
model runner, the target's CUDA graphs, the draft exchange and the speculation policy."""
