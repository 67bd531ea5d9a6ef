#!/usr/bin/env bash
# The GPU benchmark calls (docs/performance.md): writes the Llama-3.1-8B-shaped random bf16
# target, its EAGLE-3 head (draft vocabulary 32000) and a Llama-3.2-1B-shaped assistant on the
# GPU, then runs one section of the benchmark with simulated acceptance (accept length 3.0).
# Each section fits one device call (at most 600 s; the benchmark is stopped at $BENCH_TIMEOUT,
# default 565 s); run them as separate calls:
#
#   chains        (default) S=3 chains, 128-token prompts, 128 new, bs 1, 8, 32, 64, the
#                 default modes (target-only, spec, services, hf)
#   trees         K=4, N=16, S=5 trees, otherwise as chains; modes target-only, spec, services
#                 (device-chain steps and transformers run chains only)
#   long          2,048-token prompts, 128 new, bs 1, 8, 32, S=3 chains; modes target-only,
#                 spec, services, services-chain
#   long-trees    long, with the trees' shape; modes target-only, spec, services
#   sampled       chains as above with every request sampled (--temperature 0.8); modes
#                 target-only, spec, services
#   draft-device  the draft service on the second GPU (--draft-device cuda:1; needs two GPUs:
#                 nvidia-h200-x2), S=3 chains, bs 1, 8, 32; modes target-only, spec, services
#   all           every section above in turn (where no per-call limit applies; too many files
#                 for one device call to bring back)
#
# Extra arguments go to `tandem bench` after the section's (a repeated flag takes the last
# value: e.g. --spec-policy adaptive, --modes spec,services). On the device machine, from the
# repo root (carry ".whl"; bench/device_wheels.sh makes it):
#
#   bash bench/gpu_bench.sh [flags]            -> $OUT/bench.json, $OUT/bench.txt,
#                                                 $OUT/plots/*.png, $OUT/service-logs.tgz
#   bash bench/gpu_bench.sh SECTION [flags]    -> the same names with -SECTION after them
#                                                 (bench-trees.json, plots-trees/, ...), where
#                                                 SECTION is not chains
set -uo pipefail
OUT=${OUT:-out/gpu}
MODELS=${MODELS:-/tmp/tandem-bench-models}
SECTION=chains
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then SECTION=$1; shift; fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
TREES=(--spec-topk 4 --spec-tokens 16 --spec-steps 5)
LONG=(--prompt-len 2048 --new-tokens 128 --batch-sizes 1,8,32)

section_args() {  # the flags of section $1, one a line
  case $1 in
    chains) ;;
    trees) printf '%s\n' "${TREES[@]}" --modes target-only,spec,services ;;
    long) printf '%s\n' "${LONG[@]}" --modes target-only,spec,services,services-chain ;;
    long-trees) printf '%s\n' "${LONG[@]}" "${TREES[@]}" --modes target-only,spec,services ;;
    sampled) printf '%s\n' --temperature 0.8 --modes target-only,spec,services ;;
    draft-device)
      printf '%s\n' --draft-device cuda:1 --batch-sizes 1,8,32 --modes target-only,spec,services
      ;;
    *) echo "gpu_bench.sh: unknown section $1 (chains, trees, long, long-trees, sampled, draft-device, all)" >&2
       return 2 ;;
  esac
}

run_section() {  # section name, then the extra flags
  local suffix="" rc
  [ "$1" = chains ] || suffix="-$1"
  local name=$1 logs="$OUT/service-logs$suffix" txt="$OUT/bench$suffix.txt"
  shift
  local args
  args=$(section_args "$name") || return 2
  mapfile -t args <<< "$args"
  [ -n "${args[*]}" ] || args=()
  # SIGINT at $BENCH_TIMEOUT s (the services are stopped on the way out); progress lines go to
  # bench.txt.
  timeout -s INT -k 15 "${BENCH_TIMEOUT:-565}" python3 bench/speculative.py \
    --preset llama-3.1-8b --device cuda --models-dir "$MODELS" \
    --batch-sizes 1,8,32,64 --prompt-len 128 --new-tokens 128 --warmup-tokens 16 --rounds 1 \
    --spec-steps 3 --simulate-accept-length 3.0 \
    --log-dir "$logs" --plot "$OUT/plots$suffix" --json "${args[@]}" "$@" \
    > "$OUT/bench$suffix.json" 2> "$txt"
  rc=$?
  # The device tool returns at most 8 files from $OUT, none more than two folders down: the
  # services' logs, step logs and profiles go back as one archive (KEEP_LOGS=1 keeps the folder).
  if [ -d "$logs" ] && [ "${KEEP_LOGS:-0}" != 1 ]; then
    tar czf "$logs.tgz" -C "$OUT" "service-logs$suffix" && rm -rf "$logs"
  fi
  cat "$txt"
  return $rc
}

if [ "$SECTION" = all ]; then
  rc=0
  for s in chains trees long long-trees sampled draft-device; do
    if [ "$s" = draft-device ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
      echo "gpu_bench.sh: draft-device skipped: one GPU" >&2
      continue
    fi
    run_section "$s" "$@" || rc=$?
  done
  exit $rc
fi
run_section "$SECTION" "$@"
