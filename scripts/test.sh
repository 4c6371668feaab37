#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit, contract, integration
# (real runc/runsc, overlayfs, netns as root) and end-to-end. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then  # as setup.sh: say what to run instead of failing half-way
  echo "scripts/test.sh must run as root (integration tests use real runc, mounts, cgroups, netns)." >&2
  if command -v sudo >/dev/null 2>&1; then echo "Run:  sudo scripts/test.sh${*:+ $*}" >&2
  else echo "Run it from a root shell (no sudo here):  su -c 'scripts/test.sh${*:+ $*}'" >&2; fi
  exit 1
fi
scripts/setup.sh
ulimit -n 20000 2>/dev/null || true
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
