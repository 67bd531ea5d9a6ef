#!/usr/bin/env bash
# The one GPU call: environment, GPU tests, the CPU suite on the GPU image's versions (torch
# 2.11, transformers 5.17, grpcio 1.84) and, as they land, benchmarks. Prints a short table;
# full logs go to $OUT. Usage on the device machine, from the repo root: bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

python3 - <<'PY' | tee "$OUT/env.txt"
import grpc, google.protobuf, torch, transformers
from tandem.v1 import common_pb2_grpc, draft_pb2_grpc, gateway_pb2_grpc, target_pb2_grpc  # noqa
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"device {name} | torch {torch.__version__} | transformers {transformers.__version__} | "
      f"grpcio {grpc.__version__} | protobuf {google.protobuf.__version__} | stubs import")
PY

status() { if [ "$1" -eq 0 ]; then echo pass; else echo "FAIL($1)"; fi; }
python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.log" 2>&1
gpu_rc=$?
# test_protos regenerates stubs with grpcio-tools and runs buf: neither is on the GPU image.
python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/unit/test_protos.py -m "not gpu" \
  > "$OUT/cpu_suite.log" 2>&1
cpu_rc=$?

printf '%-40s %-8s %s\n' "check" "result" "summary"
printf '%-40s %-8s %s\n' "GPU tests (-m gpu)" "$(status $gpu_rc)" "$(tail -n 1 "$OUT/gpu_tests.log")"
printf '%-40s %-8s %s\n' "CPU suite on the GPU image" "$(status $cpu_rc)" "$(tail -n 1 "$OUT/cpu_suite.log")"
[ "$gpu_rc" -eq 0 ] && [ "$cpu_rc" -eq 0 ]
