#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite with ctest. GPU tests report "skipped" without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600
