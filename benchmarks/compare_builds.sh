#!/usr/bin/env bash
# Speed of this tree against another build of kvserve, on one GPU in one run, so the two are
# compared on the same machine: batch-1 decode and 256 offline requests (gpu_check.py), and the
# decode step at 32 x 32k with bf16, fp8 and int4 KV (kv_compression.py). Builds alternate.
#
#   git archive BASE kvserve benchmarks | (mkdir -p build/base && tar -x -C build/base)
#   bash benchmarks/compare_builds.sh build/base $OUT [gpu|kv|host|all]
#
# Results: $OUT/{base,head}/*.json and a table per build on stdout. ``host`` (not in ``all``):
# offline 256 and 1,024 requests and batch-1 decode (engine_host.py, this tree's copy run on
# both builds), three alternations, then one table of the pairs; JSON in $OUT/host/.
set -uo pipefail
base=$(cd "$1" && pwd)
mkdir -p "$2" && out=$(cd "$2" && pwd)  # absolute: each build runs from its own folder
what=${3:-all}
head=$(cd "$(dirname "$0")/.." && pwd)
run() {  # run NAME DIR ARGS...: one benchmark of one build
  local name=$1 dir=$2; shift 2
  mkdir -p "$out/$name"
  echo "=== $name: $*" >&2
  (cd "$dir" && PYTHONPATH=$dir python "$@" --out "$out/$name") 2>&1 | tail -n 25
}
if [ "$what" = all ] || [ "$what" = gpu ]; then
  for b in base head; do
    dir=$base; [ "$b" = head ] && dir=$head
    run "$b" "$dir" benchmarks/gpu_check.py --only decode,offline --quick --offline-sizes 256 --no-async-ab
  done
fi
if [ "$what" = all ] || [ "$what" = kv ]; then
  for b in base head; do
    dir=$base; [ "$b" = head ] && dir=$head
    run "$b" "$dir" benchmarks/kv_compression.py --only decode --formats auto,fp8,int4
  done
fi
if [ "$what" = host ]; then
  mkdir -p "$out/host"
  for i in 1 2 3; do
    for b in base head; do
      dir=$base; [ "$b" = head ] && dir=$head
      echo "=== host $b $i" >&2
      (cd "$dir" && PYTHONPATH=$dir python "$head/benchmarks/engine_host.py" --device cuda --tag "$b" \
        --out "$out/host") 2>&1 | tail -n 3
    done
  done
  python "$head/benchmarks/engine_host.py" --summarize "$out/host"
fi
