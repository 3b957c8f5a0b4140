#!/usr/bin/env bash
# ensure-command.sh COMMAND DEBIAN_PACKAGE
# Make sure COMMAND is on PATH: `make setup` uses it for etcd (the services' store)
# and promtool (the tests lint every /metrics page and the alert rules with it).
# Installs the Debian package when the command is missing and we can (root or
# passwordless sudo); otherwise says what to do. Packages that start a system
# service on install (etcd on 2379, Prometheus on 9090) have it stopped again: the
# project runs its own etcd and needs only promtool.
set -euo pipefail
command_name=${1:?usage: ensure-command.sh COMMAND DEBIAN_PACKAGE}
package=${2:?usage: ensure-command.sh COMMAND DEBIAN_PACKAGE}
if command -v "$command_name" >/dev/null 2>&1; then
  exit 0
fi
echo "$command_name not found: installing Debian's $package package"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "error: $command_name is not installed and this user cannot install packages." >&2
  echo "Install it (e.g. 'apt-get install $package') and re-run." >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "$package" >/dev/null
$SUDO service "$package" stop >/dev/null 2>&1 || $SUDO service "$command_name" stop >/dev/null 2>&1 || true
command -v "$command_name" >/dev/null || { echo "error: $package did not provide $command_name" >&2; exit 1; }
"$command_name" --version 2>&1 | head -1
