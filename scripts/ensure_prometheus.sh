#!/usr/bin/env bash
# Prometheus for tests/e2e/test_dashboard_prometheus.py (which runs every query
# of the Grafana dashboard against it): nothing to do when `prometheus` is on
# PATH, else the distribution's package (Debian/Ubuntu), with sudo unless root.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y --no-install-recommends prometheus
command -v prometheus >/dev/null
