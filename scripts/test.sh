#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit, contract, integration
# (real runc/runsc, overlayfs, netns as root) and end-to-end. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ulimit -n 20000 2>/dev/null || true
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
