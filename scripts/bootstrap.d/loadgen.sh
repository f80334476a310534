#!/usr/bin/env bash
# The side environment .venv/loadgen holding guidellm (requirements/loadgen.txt), the load generator
# tests/services/test_clients_guidellm.py runs against `hybridcache up`. guidellm pins click~=8.4
# and pulls datasets (pyarrow, pandas), sanic and uvloop, none of which may change the test
# environment: they go into a venv of their own, which reaches .venv's packages (torch,
# transformers, ...) through a .pth appended after its own site-packages, so its pins win there.
# Idempotent: a stamp keyed on this script and requirements/loadgen.txt skips a redone install.
set -euo pipefail
cd "$(dirname "$0")/../.."

SIDE=.venv/loadgen
STAMP=$SIDE/.loadgen-stamp
want=$(cat scripts/bootstrap.d/loadgen.sh requirements/loadgen.txt | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$SIDE/bin/guidellm" --version >/dev/null 2>&1; then
    exit 0
fi

# no pip of its own: .venv's pip, reached through the .pth, installs into it (sys.prefix decides)
rm -rf "$SIDE"
.venv/bin/python -m venv --without-pip "$SIDE"
base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
side=$("$SIDE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir appends .venv's site-packages (and its own .pth files) after the side venv's
echo "import site; site.addsitedir('$(realpath "$base")')" > "$side/zz-test-env.pth"
# torch pinned as in constraints.txt: a requirement that reached past .venv's CPU build would pull CUDA
# (--no-warn-conflicts: .venv holds sglang without its CUDA dependencies, see sglang-frontend.sh)
"$SIDE/bin/python" -m pip install -q --no-warn-conflicts -c <(grep '^torch==' constraints.txt) -r requirements/loadgen.txt
"$SIDE/bin/guidellm" --version >&2
echo "$want" > "$STAMP"
