#!/usr/bin/env bash
# Installs the Debian packages moe-run needs to build and test. Idempotent: installs only what is
# missing (apt-get update runs only then). Needs root or sudo.
set -euo pipefail
PKGS=(cmake g++ make pkg-config git libcli11-dev libfmt-dev libspdlog-dev libgtest-dev libgmock-dev
      libbenchmark-dev libutf8proc-dev python3 python3-numpy)
[ "${MOE_SETUP_FUZZ:-0}" = 1 ] && PKGS+=(clang libclang-rt-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "setup: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
