#!/usr/bin/env bash
# Creates .venv and installs everything the demo and the tests need, on a bare Debian 12 machine.
# Idempotent: a stamp keyed on this script, pyproject.toml and constraints.txt skips a redone install.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.bootstrap-stamp
want=$(cat scripts/bootstrap.sh pyproject.toml constraints.txt requirements/*.txt scripts/bootstrap.d/*.sh 2>/dev/null | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

echo "[bootstrap] creating $VENV and installing dependencies (first run takes a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip through the venv's python: a copied or moved venv's bin/pip still names the old interpreter
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q -U pip
# torch first: the CPU build on local disk. Every later call is constrained to it, or pip pulls CUDA.
"${PIP[@]}" install -q torch==2.13.0
# the project (editable) with its test and operator extras, at the versions constraints.txt pins
"${PIP[@]}" install -q -c constraints.txt -r requirements/test.txt

# Debian packages (etcd, prometheus, ...) when missing.
apt_pkgs=$(grep -v '^#' requirements/apt.txt | tr '\n' ' ' | xargs || true)
if [ -n "$apt_pkgs" ]; then
    missing=""
    for p in $apt_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
    if [ -n "$missing" ]; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    fi
fi
# Extra installers of individual parts (e.g. helm/kubectl for the chart tests).
for f in scripts/bootstrap.d/*.sh; do [ -e "$f" ] && bash "$f"; done
echo "$want" > "$STAMP"
