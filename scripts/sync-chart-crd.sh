#!/usr/bin/env bash
# Copies the single sources in manifests/ into the chart (a chart cannot read files outside its
# directory): the CRD, the Grafana dashboard and the alert rules. Run after editing any of them;
# tests/operator/test_chart_helm.py fails while the copies differ.
set -euo pipefail
cd "$(dirname "$0")/.."

chart=charts/hybridcache
cp manifests/crd/hybridcache.yaml "$chart/crds/hybridcache.yaml"
cp manifests/dashboards/hybridcache.json "$chart/files/hybridcache.json"
cp manifests/alerts/hybridcache-rules.yaml "$chart/files/hybridcache-rules.yaml"
echo "synced CRD, dashboard and alert rules into $chart" >&2
