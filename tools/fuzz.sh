#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for SECONDS (default 60).
# Seed corpora come from the fixtures; findings are written to build-fuzz/findings/.
# Usage: tools/fuzz.sh [SECONDS] [target...]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
MOE_SETUP_FUZZ=1 tools/setup.sh
B=${BUILD_DIR:-build-fuzz}
CC=clang CXX=clang++ cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_FUZZ=ON -DMOE_TESTS=OFF \
  -DMOE_BENCH=OFF -DMOE_CUDA=OFF >/dev/null
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=()
  for f in tools/fuzz/fuzz_*.cpp; do targets+=("$(basename "${f%.cpp}")"); done
fi
cmake --build "$B" -j "$(nproc)" --target "${targets[@]}"
python3 tools/fuzz/make_seeds.py "$B/seeds"
mkdir -p "$B/findings"
status=0
for t in "${targets[@]}"; do
  corpus="$B/corpus/$t"
  mkdir -p "$corpus"
  seeds="$B/seeds/${t#fuzz_}"
  echo "== $t: ${SECONDS_EACH}s" >&2
  # -rss_limit_mb keeps a leak or a runaway allocation a finding instead of taking the machine down.
  if ! "$B/bin/$t" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -max_len=262144 -timeout=20 \
      -artifact_prefix="$B/findings/$t-" -print_final_stats=1 "$corpus" "$seeds" 2>"$B/$t.log"; then
    echo "$t: FINDING (see $B/$t.log and $B/findings/)" >&2
    tail -40 "$B/$t.log" >&2
    status=1
  else
    grep -E 'stat::number_of_executed_units|Done [0-9]+ runs' "$B/$t.log" | tail -2 >&2 || true
  fi
done
exit $status
