#!/usr/bin/env bash
# Make sure an etcd server (>= 3.4) is on PATH. Installs Debian's etcd-server when
# it is missing and we can (root or passwordless sudo); otherwise says what to do.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
echo "etcd not found: installing Debian's etcd-server package"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "error: etcd is not installed and this user cannot install packages." >&2
  echo "Install etcd >= 3.4 (e.g. 'apt-get install etcd-server') and re-run." >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq etcd-server >/dev/null
# The package may start a system etcd on 2379; the project runs its own.
$SUDO service etcd stop >/dev/null 2>&1 || true
command -v etcd >/dev/null && etcd --version | head -1
