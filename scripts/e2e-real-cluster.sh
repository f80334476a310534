#!/usr/bin/env bash
# End-to-end check of the chart and operator on a real Kubernetes API server: what the offline
# tests cannot show (server-side validation and defaulting, printer columns, /scale, garbage
# collection), plus the emulator conformance suite run against the real server.
#
#   scripts/e2e-real-cluster.sh            # uses the cluster of the current KUBECONFIG context
#   scripts/e2e-real-cluster.sh --kind     # creates a kind cluster, builds and loads the image
#
# Needs kubectl and helm (.venv/bin has both after `make test`), and for --kind: kind, docker.
# Pods need not become ready (the GPU example has no GPUs in kind): only the API is checked.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBECTL=${KUBECTL:-$(command -v kubectl || echo .venv/bin/kubectl)}
HELM=${HELM:-$(command -v helm || echo .venv/bin/helm)}
NS=${NS:-hybridcache-e2e}
RELEASE=${RELEASE:-hc-e2e}
IMAGE_TAG=${IMAGE_TAG:-0.1.0}
KIND_CLUSTER=hybridcache-e2e
use_kind=false
[ "${1:-}" = "--kind" ] && use_kind=true

log() { printf '[e2e] %s\n' "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

# Poll a command until it succeeds, at most $1 seconds.
wait_until() {
    local timeout=$1; shift
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 2
    done
}

cleanup() {
    "$HELM" uninstall "$RELEASE" -n "$NS" >/dev/null 2>&1 || true
    "$KUBECTL" delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
    if $use_kind; then kind delete cluster --name "$KIND_CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

if $use_kind; then
    log "creating kind cluster $KIND_CLUSTER"
    kind create cluster --name "$KIND_CLUSTER" --wait 120s
    docker build -t "hybridcache/hybridcache-serve:$IMAGE_TAG" .
    kind load docker-image "hybridcache/hybridcache-serve:$IMAGE_TAG" --name "$KIND_CLUSTER"
fi

log "installing the chart (CRD, RBAC, operator) into $NS"
"$HELM" upgrade --install "$RELEASE" charts/hybridcache --namespace "$NS" --create-namespace \
    --set image.tag="$IMAGE_TAG" --wait --timeout 5m

log "server-side validation: CEL rule min <= max"
invalid=$(mktemp)
cat >"$invalid" <<YAML
apiVersion: serving.hybridcache.io/v1alpha1
kind: HybridCache
metadata: {name: invalid, namespace: $NS}
spec:
  model: {arch: qwen3_5_text, path: /app/models/tiny}
  scatter: {autoscaling: {minReplicas: 5, maxReplicas: 2}}
YAML
if out=$("$KUBECTL" apply --dry-run=server -f "$invalid" 2>&1); then
    fail "the API server accepted minReplicas > maxReplicas"
fi
grep -q "minReplicas must not exceed maxReplicas" <<<"$out" || fail "unexpected rejection: $out"

log "creating the CPU demo (External mode, so /scale drives the scatter workers)"
sed -e "s/mode: Operator/mode: External/" manifests/examples/cpu-demo.yaml | "$KUBECTL" apply -n "$NS" -f -

log "server-side defaulting"
[ "$("$KUBECTL" get hc demo -n "$NS" -o jsonpath='{.spec.engine.prefixPolicy}')" = exact_replay ] \
    || fail "CRD defaults were not applied"

log "the operator creates the children"
for child in deployment/demo-router deployment/demo-combine deployment/demo-scatter statefulset/demo-cache-tier \
        service/demo-router configmap/demo-config networkpolicy/demo; do
    wait_until 120 "$KUBECTL" get -n "$NS" "$child" || fail "$child was not created"
done
owner=$("$KUBECTL" get deployment demo-router -n "$NS" -o jsonpath='{.metadata.ownerReferences[0].kind}')
[ "$owner" = HybridCache ] || fail "demo-router is not owned by the HybridCache"

log "status and printer columns"
wait_until 120 test -n "$("$KUBECTL" get hc demo -n "$NS" -o jsonpath='{.status.observedGeneration}')" \
    || fail "status.observedGeneration was never set"
header=$("$KUBECTL" get hc -n "$NS" | head -1)
for column in NAME MODEL READY SCATTER DESIRED COLD-QUEUE AGE; do
    grep -qw -- "$column" <<<"$header" || fail "printer column $column missing: $header"
done
"$KUBECTL" get hybridcaches.serving.hybridcache.io -n "$NS" demo >/dev/null

log "/scale subresource (what HPA and KEDA use)"
"$KUBECTL" scale hc/demo -n "$NS" --replicas=2
wait_until 120 test "$("$KUBECTL" get deployment demo-scatter -n "$NS" -o jsonpath='{.spec.replicas}')" = 2 \
    || fail "the scatter Deployment did not follow /scale"

log "garbage collection of children"
"$KUBECTL" delete hc demo -n "$NS" --wait=true --timeout=120s
wait_until 120 bash -c "! '$KUBECTL' get deployment demo-router -n '$NS'" \
    || fail "children were not garbage-collected"

if [ -x .venv/bin/python ]; then
    log "emulator conformance suite against this API server"
    HYBRIDCACHE_CONFORMANCE_KUBECONFIG=${KUBECONFIG:-$HOME/.kube/config} \
        .venv/bin/python -m pytest -q tests/operator/test_operator_emulator_conformance.py
fi

log "all checks passed"
