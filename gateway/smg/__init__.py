"""The gateway's second public service: the SMG router's gRPC worker protocol (``server``) and
its mapping onto the native request path (``convert``)."""
