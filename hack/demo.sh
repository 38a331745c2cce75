#!/usr/bin/env bash
# make demo: shows what csiagent does so far, on any fresh Linux machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
agent=bin/csi-agent
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "csi-agent version"
$agent version

step "validate the shipped plugin configs: csi-agent check-config testdata/plugins"
$agent check-config testdata/plugins

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp testdata/plugins/*.json "$work/"
printf '{"type": "broken.example", "containers": [{"services": ["NODE"], "command": {"value": "x"}}]}\n' >"$work/broken.json"
printf '{"type": "loop.csi.csiagent.io", "endpoints": [{"csi_service": "NODE_SERVICE", "endpoint": "/run/x.sock"}]}\n' >"$work/zz-duplicate.json"
step "a directory with a bad file and a duplicate type: the good plugins still load, exit code 1"
set +e
$agent check-config "$work"
rc=$?
set -e
echo "exit code: $rc"
[[ $rc == 1 ]] || { echo "demo: expected exit code 1 for an invalid directory" >&2; exit 1; }

step "the same as JSON for scripts: csi-agent check-config --output json"
$agent check-config --output json testdata/plugins >"$work/report.json"
head -n 12 "$work/report.json"
echo "  ..."
