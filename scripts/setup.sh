#!/usr/bin/env bash
# Set up DSec on a fresh Debian 12 machine, as root: system packages, the Python venv,
# the sandbox init binary and the stock images (busybox, python). Idempotent and fast
# when everything is already there. Usage: scripts/setup.sh [--no-images]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

say() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

# Root only (packages, mounts, cgroups, namespaces). A root shell needs no sudo (and a
# container or VM image often has none); a non-root user is told what to run.
if [ "$(id -u)" != 0 ]; then
  self="scripts/$(basename "$0")"
  echo "$self must run as root: it installs system packages, and sandboxes need mounts, cgroups and namespaces." >&2
  if command -v sudo >/dev/null 2>&1; then
    echo "Run:  sudo $self${*:+ $*}" >&2
  else
    echo "Run it from a root shell (no sudo here):  su -c '$self${*:+ $*}'" >&2
  fi
  exit 1
fi

# --- system packages ------------------------------------------------------------------
APT_PACKAGES=(
  runc runsc               # OCI runtimes: container tier, gVisor tier
  busybox-static           # the busybox stock image
  mmdebstrap               # builds the python stock image offline from Debian packages
  gcc libc6-dev            # builds the static sandbox init (dsec-init)
  util-linux iproute2 nftables  # unshare/setpriv, netns/veth, egress policy
  podman umoci skopeo      # baselines for benchmarks, OCI interop tests
  docker-registry apache2-utils  # CNCF distribution registry + htpasswd: image push/pull tests
  redis-server socat iperf3     # multi-node state tests, network tests
  python3-venv ca-certificates
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing system packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# podman needs a policy file to load local archives in benchmarks.
[ -f /etc/containers/policy.json ] || { mkdir -p /etc/containers; \
  echo '{"default":[{"type":"insecureAcceptAnything"}]}' > /etc/containers/policy.json; }

# --- Python ------------------------------------------------------------------------------
PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' 2>/dev/null || {
  echo "DSec needs Python >= 3.11 as python3 (or set PYTHON=/path/to/python3.11)" >&2; exit 1; }
stamp=.venv/.dsec-installed
want=$( (cat pyproject.toml; echo 'extras: dev,ray') | sha256sum | cut -c1-16)  # re-install when the extras change
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "creating the virtualenv (.venv) and installing DSec with its dev tools"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[dev,ray]'  # ray: the cluster (dsec cluster up, tests/contract/node)
  # verl's sandbox_fusion reward module needs only requests; verl's own deps (torch...) are not wanted here
  .venv/bin/pip install -q --no-deps 'verl>=0.4'
  echo "$want" > "$stamp"
fi

# --- sandbox init binary and stock images -----------------------------------------------
export DSEC_HOME=${DSEC_HOME:-/var/lib/dsec}
mkdir -p "$DSEC_HOME"
say "building the sandbox init (dsec-init) into $DSEC_HOME/bin"
.venv/bin/python -c "from pathlib import Path; import os; from dsec.runtime.agent_build import ensure_agent_binary; print(ensure_agent_binary(Path(os.environ['DSEC_HOME'])/'bin'))" >/dev/null
if [ "${1:-}" != "--no-images" ]; then
  say "ensuring stock images (busybox, python) in $DSEC_HOME"
  .venv/bin/dsec image ensure-stock
fi
say "ready: $ROOT/.venv/bin/dsec"
