#!/usr/bin/env bash
# Make sure `promtool` (Prometheus' checker) is on PATH: the tests run it on every
# service's /metrics page and on deploy/prometheus/. Installs Debian's prometheus
# package when it is missing and we can (root or passwordless sudo); otherwise says
# what to do. Same pattern as ensure-etcd.sh.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
echo "promtool not found: installing Debian's prometheus package"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "error: promtool is not installed and this user cannot install packages." >&2
  echo "Install Prometheus' promtool (e.g. 'apt-get install prometheus') and re-run." >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start a system Prometheus on 9090; the project needs only promtool.
$SUDO service prometheus stop >/dev/null 2>&1 || true
command -v promtool >/dev/null && promtool --version 2>&1 | head -1
