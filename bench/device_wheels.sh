#!/usr/bin/env bash
# Downloads into .whl/ the pure-Python wheels the GPU image lacks (it has torch, triton,
# transformers, grpcio, protobuf, prometheus-client, wrapt, typer, rich, pyyaml), so device runs
# can `pip install --no-index --target /tmp/site .whl/*.whl` (the GPU machine has no network).
# Versions follow this venv's, so the device runs what CI tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
pkgs=(
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-exporter-prometheus
  opentelemetry-exporter-otlp-common
  tenacity grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos
)
pins=()
for p in "${pkgs[@]}"; do
  v=$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")
  pins+=("$p==$v")
done
# The image's grpcio is 1.84.0 and generated health/reflection stubs refuse an older grpcio
# than their generator: take the 1.84.0 builds of those three.
for i in "${!pins[@]}"; do
  case "${pins[$i]}" in grpcio-health-checking==*|grpcio-reflection==*|grpcio-status==*)
    pins[$i]="${pins[$i]%%==*}==1.84.0";;
  esac
done
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls .whl
