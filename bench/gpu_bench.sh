#!/usr/bin/env bash
# The GPU benchmark call (docs/performance.md): writes the Llama-3.1-8B-shaped random bf16
# target, its EAGLE-3 head (draft vocabulary 32000) and a Llama-3.2-1B-shaped assistant on the
# GPU, then runs every mode at bs 1, 8, 32, 64 with simulated acceptance. Extra arguments go to
# `tandem bench` (e.g. --simulate-accept-length 2.5). On the device machine, from the repo root
# (carry ".whl"; bench/device_wheels.sh makes it):
#
#   bash bench/gpu_bench.sh            -> $OUT/bench.json, $OUT/bench.txt, $OUT/plots/*.png,
#                                         $OUT/service-logs.tgz
set -uo pipefail
OUT=${OUT:-out/gpu}
MODELS=${MODELS:-/tmp/tandem-bench-models}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# SIGINT at $BENCH_TIMEOUT s (default 565; the services are stopped on the way out); progress lines go to bench.txt.
timeout -s INT -k 15 "${BENCH_TIMEOUT:-565}" python3 bench/speculative.py \
  --preset llama-3.1-8b --device cuda --models-dir "$MODELS" \
  --batch-sizes 1,8,32,64 --prompt-len 128 --new-tokens 128 --warmup-tokens 16 --rounds 1 \
  --spec-steps 3 --simulate-accept-length 3.0 \
  --log-dir "$OUT/service-logs" --plot "$OUT/plots" --json "$@" \
  > "$OUT/bench.json" 2> "$OUT/bench.txt"
rc=$?
# The device tool returns at most 8 files from $OUT, none more than two folders down: the
# services' logs, step logs and profiles go back as one archive (KEEP_LOGS=1 keeps the folder).
if [ -d "$OUT/service-logs" ] && [ "${KEEP_LOGS:-0}" != 1 ]; then
  tar czf "$OUT/service-logs.tgz" -C "$OUT" service-logs && rm -rf "$OUT/service-logs"
fi
cat "$OUT/bench.txt"
exit $rc
