#!/usr/bin/env bash
# Installs Debian's nsight-systems (non-free component) when running as root with apt.
set -euo pipefail
command -v nsys >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || { echo "install_nsys: no apt-get" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "install_nsys: needs root" >&2; exit 1; }
src=/etc/apt/sources.list.d/debian.sources
if [ -f "$src" ] && ! grep -q non-free "$src"; then
  sed -i 's/^Components: main$/Components: main contrib non-free/' "$src"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -qq update >/dev/null
apt-get -qq install -y --no-install-recommends nsight-systems >/dev/null
command -v nsys >/dev/null
