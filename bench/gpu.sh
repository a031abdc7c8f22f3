#!/usr/bin/env bash
# Build, test, sanitize and benchmark pyfedkern on a CUDA machine in one go (the lent GPU of a development session).
# Usage: bash bench/gpu.sh OUT_DIR [STEPS]   STEPS: a comma list of build,test,sanitize,overhead,profile,bench,engine,
# run10k
# (default build,test,sanitize,bench); BENCH_FILES limits the bench step to some suites.
# Writes the pytest-benchmark JSONs, their reports and logs.tgz into OUT_DIR; a wheel already in ./wheels is
# installed instead of rebuilding unless STEPS has build.
set -uo pipefail
out=${1:?usage: bash bench/gpu.sh OUT_DIR [STEPS]}
steps=${2:-build,test,sanitize,bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=python3
has() { [[ ",$steps," == *",$1,"* ]]; }
stamp() { echo "== $(date +%T) $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
wheel=$(ls wheels/pyfedkern-*.whl 2>/dev/null | head -1)
if has build || [ -z "$wheel" ]; then
  stamp build
  CMAKE_BUILD_PARALLEL_LEVEL=16 PYFEDKERN_CUDA=ON $py -m pip wheel --no-build-isolation --no-deps -w wheels \
    --config-settings=cmake.define.PYFEDKERN_CUDA_ARCHS=90-real . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  wheel=$(ls -t wheels/pyfedkern-*.whl | head -1)
fi
$py -m pip install -q --no-deps --force-reinstall "$wheel" >/dev/null 2>&1
$py -P -c "import pyfedkern; print(pyfedkern.build_info())" | tee -a "$out/gpu.txt"

if has test; then
  stamp "cuda tests"
  timeout 300 $py -P -m pytest -m cuda tests -q -p no:cacheprovider >"$out/cuda-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/cuda-tests.log" | tail -25
fi
if has sanitize; then
  stamp "compute-sanitizer memcheck on the CUDA op tests"
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 $py -P -m pytest -m cuda tests/ops -q \
    -k "not profiler and not allocates" -p no:cacheprovider >"$out/memcheck.log" 2>&1
  grep -E "ERROR SUMMARY|passed|failed" "$out/memcheck.log" | tail -3
fi
if has overhead; then
  stamp "per-call overhead"
  $py -P bench/overhead.py --device cuda --json "$out/overhead-cuda.json" | tee "$out/overhead-cuda.md"
fi
if has profile; then
  stamp "profiles"
  timeout 120 $py -P bench/profile_ops.py >"$out/profile.txt" 2>&1
fi
if has bench; then
  stamp "benchmarks (cuda groups)"
  timeout 420 $py -P -m pytest ${BENCH_FILES:-bench/} -k "cuda and not fedpbc_round and not engine" -q \
    -p no:cacheprovider \
    --benchmark-json="$out/bench-cuda.json" >"$out/bench.log" 2>&1
  tail -2 "$out/bench.log"
  $py -P bench/report.py "$out/bench-cuda.json" --title "pyfedkern CUDA benchmarks ($(head -1 "$out/gpu.txt"))" \
    >"$out/bench-cuda.md" && grep -E "^\| " "$out/bench-cuda.md" | head -0
fi
if has engine; then
  stamp "engine rounds ($py bench/engine_gpu.py)"
  timeout 300 $py -P bench/engine_gpu.py cuda | tee "$out/engine-rounds.md"
fi
if has run10k; then
  stamp "10,000-client FedAvg runs (pyfedkern run) on cuda and cpu"
  for dev in cuda cpu; do
    /usr/bin/time -f "$dev: %e s wall" timeout 200 $py -P -m pyfedkern run --algorithm fedavg \
      --dataset synthetic:1,1,10000 --partition natural --clients 10000 --model logreg --rounds 5 --device $dev \
      --no-progress --out "/tmp/run10k-$dev" >"$out/run10k-$dev.log" 2>&1
    tail -1 "$out/run10k-$dev.log"
    $py -c "import json,sys; [print(sys.argv[1], r['round'], 'round %.3f s local %.3f s aggregation %.3f s' % \
      (r['time_round'], r['time_local'], r['time_aggregation'])) for r in map(json.loads, open(sys.argv[2])) \
      if 'time_round' in r]" $dev "/tmp/run10k-$dev/metrics.jsonl" | tee -a "$out/run10k.txt"
  done
fi
# logs in one archive (a lent machine returns few files)
(cd "$out" && tar czf logs.tgz --remove-files $(ls *.log profile.txt overhead-cuda.json 2>/dev/null))
stamp done
