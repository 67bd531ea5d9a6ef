"""The proposer engine: drafters of every kind, their CUDA graphs and buffers,
and ``build`` (a drafter from a checkpoint and its kind)."""
