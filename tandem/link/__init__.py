"""The target <-> draft stream, both ends: ``RemoteDrafter`` (the target's end),
the transports (gRPC, the local socket), the messages, the shared prompt buffer and
CUDA IPC."""
