"""Generated stubs of the SMG router's gRPC worker protocol (``protos/tandem/smg``, vendored
from smg-grpc-proto 0.4.28): ``sglang_scheduler_pb2*`` and ``common_pb2*``. Do not edit; run
``python protos/generate.py``. Served by ``gateway.smg``."""
