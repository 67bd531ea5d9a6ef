"""Server plumbing shared by the three services: gRPC servers and errors,
security, telemetry, profiling and the health probe."""
