"""Composition roots: the ``tandem`` command, the demo, the local launcher,
the client and the embedded default model family."""
