#!/usr/bin/env bash
# The GPU call: environment, GPU tests, kernel benchmarks and (on request) the CPU suite on the
# GPU image's versions (torch 2.11, transformers 5.17, grpcio 1.84). Prints a short table; full
# logs go to $OUT. Usage on the device machine, from the repo root:
#
#   bash bench/gpu_check.sh [SECTION ...]     sections: gpu gpu-low gpu-spec gpu-e2e compiled
#                                             kernels profile prefill parity invariant chain cpu
#                                             (default: gpu compiled kernels)
#
# One call may run 600 s, and `gpu` (every GPU test) no longer fits one on a fresh machine, so
# it is split: `gpu-low` (tests/kernels, tests/unit, tests/service, tests/train), `gpu-spec`
# (tests/spec) and `gpu-e2e` (tests/e2e), a call each (each takes several minutes; the last two
# together may not fit); run `compiled kernels` in a call of its own too.
#
# Wheels the image lacks travel in .whl/ (bench/device_wheels.sh makes it; carry ".whl").
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(gpu compiled kernels)
want() { [[ " ${sections[*]} " == *" $1 "* ]]; }

python3 - <<'PY' | tee "$OUT/env.txt"
import grpc, google.protobuf, torch, transformers, triton
from tandem.v1 import common_pb2_grpc, draft_pb2_grpc, gateway_pb2_grpc, target_pb2_grpc  # noqa
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"device {name} | torch {torch.__version__} | triton {triton.__version__} | "
      f"transformers {transformers.__version__} | grpcio {grpc.__version__} | "
      f"protobuf {google.protobuf.__version__} | stubs import")
PY

status() { if [ "$1" -eq 0 ]; then echo pass; else echo "FAIL($1)"; fi; }
rows=()
row() { rows+=("$(printf '%-44s %-8s %s' "$1" "$(status "$2")" "$(tail -n 1 "$3")")"); }
rc_all=0

# GPU tests (kernels vs references on CUDA, model parity, spec parity through the kernels).
# tests/deploy needs cryptography (not on the image) and holds no GPU test.
gpu_tests() {  # name, directories
  local name=$1; shift
  python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$OUT/$name.log" 2>&1
  rc=$?; row "GPU tests (-m gpu $*)" $rc "$OUT/$name.log"; rc_all=$((rc_all | rc))
}
want gpu && gpu_tests gpu_tests tests --ignore=tests/deploy
want gpu-low && gpu_tests gpu_tests_low tests/kernels tests/unit tests/service tests/train
want gpu-spec && gpu_tests gpu_tests_spec tests/spec
want gpu-e2e && gpu_tests gpu_tests_e2e tests/e2e
if want compiled; then
  # The small kernel comparisons compiled on CUDA instead of interpreted.
  python3 -m pytest -q -p no:cacheprovider tests/kernels > "$OUT/kernels_compiled.log" 2>&1
  rc=$?; row "kernel tests compiled on CUDA" $rc "$OUT/kernels_compiled.log"; rc_all=$((rc_all | rc))
fi
if want kernels; then
  python3 bench/kernels_bench.py > "$OUT/kernels_bench.txt" 2>&1
  rc=$?; row "bench/kernels_bench.py" $rc "$OUT/kernels_bench.txt"; rc_all=$((rc_all | rc))
  python3 bench/attention_bench.py > "$OUT/attention_bench.txt" 2>&1
  rc=$?; row "bench/attention_bench.py" $rc "$OUT/attention_bench.txt"; rc_all=$((rc_all | rc))
  python3 bench/fused_bench.py > "$OUT/fused_bench.txt" 2>&1
  rc=$?; row "bench/fused_bench.py" $rc "$OUT/fused_bench.txt"; rc_all=$((rc_all | rc))
fi
if want profile; then
  # Target-only decode on the 8B shape: host time per phase, GPU kernels and busy time per step.
  # Decoding ahead (the default) and synchronous steps (--no-overlap), side by side.
  for bs in 1 32; do
    for mode in overlap no-overlap; do
      name="profile_bs${bs}_$mode"
      python3 bench/profile_decode.py --batch-size $bs --steps 48 --profile-steps 6 --$mode \
        --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
      rc=$?; row "bench/profile_decode.py bs=$bs --$mode" $rc "$OUT/$name.txt"
      rc_all=$((rc_all | rc))
    done
  done
fi
if want prefill; then
  # A lone prompt's prefill on the 8B shape, through the prefill graphs and eagerly, and the
  # graph tests (replays against eager steps, bit for bit under batch-invariant kernels).
  for graphs in on off; do
    flag=(); [ $graphs = off ] && flag=(--prefill-graph-tokens off)
    python3 bench/profile_prefill.py "${flag[@]}" > "$OUT/prefill_$graphs.txt" 2>&1
    rc=$?; row "bench/profile_prefill.py graphs $graphs" $rc "$OUT/prefill_$graphs.txt"
    rc_all=$((rc_all | rc))
  done
  python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels/test_prefill_graphs.py \
    tests/spec/test_cuda_graphs.py::test_lone_prompts_replay_prefill_graphs \
    > "$OUT/prefill_tests.log" 2>&1
  rc=$?; row "prefill graph tests" $rc "$OUT/prefill_tests.log"; rc_all=$((rc_all | rc))
fi
if want parity; then
  # Greedy parity through the services, reference family, 64 held-out prompts, fp32 and bf16.
  python3 bench/gpu_parity.py --log-dir "$OUT/parity-logs" --json "$OUT/parity.json" \
    > "$OUT/parity.txt" 2>&1
  rc=$?; row "bench/gpu_parity.py" $rc "$OUT/parity.txt"; rc_all=$((rc_all | rc))
fi
if want invariant; then
  # Batch-invariant kernels (EngineConfig.batch_invariant): their GPU tests (rows and tokens
  # bit-identical in any batch, bf16 speculation equal to target-only on random weights), then
  # the parity run with the target's --batch-invariant on both sides.
  python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    tests/kernels/test_batch_invariant.py \
    tests/spec/test_cuda_spec.py::test_bf16_speculation_is_bit_equal_under_batch_invariant_kernels \
    > "$OUT/invariant_tests.log" 2>&1
  rc=$?; row "batch-invariant GPU tests" $rc "$OUT/invariant_tests.log"; rc_all=$((rc_all | rc))
  python3 bench/gpu_parity.py --batch-invariant --log-dir "$OUT/parity-invariant-logs" \
    --json "$OUT/parity_invariant.json" > "$OUT/parity_invariant.txt" 2>&1
  rc=$?; row "bench/gpu_parity.py --batch-invariant" $rc "$OUT/parity_invariant.txt"
  rc_all=$((rc_all | rc))
fi
if want chain; then
  # Device-chain halves in two processes on one GPU (docs/device-cycle.md): cycle, idle, SOL.
  python3 bench/chain_ipc.py --cycles 300 > "$OUT/chain_ipc.txt" 2>&1
  rc=$?; row "bench/chain_ipc.py" $rc "$OUT/chain_ipc.txt"; rc_all=$((rc_all | rc))
fi
if want cpu; then
  # test_protos regenerates stubs with grpcio-tools and runs buf: neither is on the GPU image.
  python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/unit/test_protos.py \
    --ignore=tests/deploy -m "not gpu" \
    > "$OUT/cpu_suite.log" 2>&1
  rc=$?; row "CPU suite on the GPU image" $rc "$OUT/cpu_suite.log"; rc_all=$((rc_all | rc))
fi

printf '%-44s %-8s %s\n' "check" "result" "summary"
printf '%s\n' "${rows[@]}"
for f in "$OUT"/kernels_bench.txt "$OUT"/attention_bench.txt "$OUT"/fused_bench.txt \
         "$OUT"/profile_bs*.txt "$OUT"/prefill_*.txt "$OUT"/parity.txt "$OUT"/parity_invariant.txt \
         "$OUT"/chain_ipc.txt; do
  [ -f "$f" ] && { echo; echo "== $(basename "$f")"; cat "$f"; }
done
exit $rc_all
