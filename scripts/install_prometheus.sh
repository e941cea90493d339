#!/usr/bin/env bash
# Install Debian's `prometheus` server binary for tests/metrics/test_prometheus.py:
#
#   sudo bash scripts/install_prometheus.sh
#
# .ci/run runs it before the tests; pytest never does (without the binary that test is skipped,
# naming this command). Idempotent: does nothing when `prometheus` is already on PATH. Needs
# root (apt-get) and a Debian/Ubuntu system.
# No system service is started: a temporary /usr/sbin/policy-rc.d forbids invoke-rc.d
# from starting daemons during the install (the test runs its own prometheus on loopback).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install_prometheus.sh: prometheus is missing and installing it needs root: sudo bash $0" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus.sh: no apt-get here; install prometheus with your package manager" \
         "or put a release binary (https://prometheus.io/download/) on PATH" >&2
    exit 1
fi

policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# in case a service manager started it anyway, stop it (our test runs its own instance)
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
fi
command -v prometheus >/dev/null
prometheus --version 2>&1 | head -1
