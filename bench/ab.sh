#!/usr/bin/env bash
# Same-call A/B of two commits on the device: rows of calls on different machines move by 10-20%
# (docs/performance.md), so a change is judged on rows of both trees measured in one call,
# alternating. Here, export the older commit (the device has no git):
#
#   bash bench/ab.sh prepare REV        -> .ab/base/ (git-ignored; carry ".ab" and ".whl")
#
# On the device machine, from the repo root: the base tree's rows, then the working tree's, the
# pair twice (AB_ROUNDS pairs, to split a long A/B over calls); extra arguments go to both
# trees' bench/gpu_bench.sh (e.g. --modes spec,k0 --batch-sizes 1,8). Each run's files go to
# ab-<tree>-<round>/ (bench.txt, bench.json, service-logs.tgz, plots/) in $OUT/ab.tgz.
#
#   bash bench/ab.sh run --modes spec,k0 --batch-sizes 1,8
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    rev=${2:?usage: bench/ab.sh prepare REV}
    rm -rf .ab/base && mkdir -p .ab/base
    # the code the benchmark runs (no checkpoints or docs: the carry is capped at 64 MiB)
    git archive "$rev" bench draft_service gateway kernels tandem target_service | tar -x -C .ab/base
    git rev-parse "$rev" > .ab/base/REVISION
    echo "exported $(cat .ab/base/REVISION) to .ab/base"
    ;;
  run)
    shift
    [ -d .ab/base ] || { echo "no .ab/base: run 'bash bench/ab.sh prepare REV' here first" >&2; exit 2; }
    [ -d .whl ] && ln -sfn "$PWD/.whl" .ab/base/.whl
    OUT=${OUT:-out/gpu}
    export MODELS=${MODELS:-/tmp/tandem-bench-models}  # written once, read by both trees
    rc=0
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for tree in base work; do
        dir=$PWD; [ "$tree" = base ] && dir=$PWD/.ab/base
        (cd "$dir" && OUT="$OUT/ab-$tree-$round" BENCH_TIMEOUT=${BENCH_TIMEOUT:-120} \
          bash bench/gpu_bench.sh "$@" > /dev/null 2>&1) || rc=1
        echo "== $tree (round $round)"
        sed -n '/mode   bs/,/^times in ms/p' "$OUT/ab-$tree-$round/bench.txt" | grep -v '^times'
      done
    done
    # One archive of every run's files: the device tool returns at most 8 files from $OUT.
    (cd "$OUT" && tar czf ab.tgz ab-* && rm -rf ab-*)
    exit $rc
    ;;
  *)
    echo "usage: bash bench/ab.sh prepare REV | run [gpu_bench.sh flags]" >&2
    exit 2
    ;;
esac
