#!/usr/bin/env bash
# make demo: csiagent at work on a fresh Linux machine, in a scratch
# directory. Everything it starts, it stops.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=$PWD/bin
agent=$bin/csi-agent
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

work=$(mktemp -d /tmp/csiagent-demo.XXXXXX)
agent_pid=
cleanup() {
	[[ -n $agent_pid ]] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null
	# The agent leaves managed plugins running for its successor; the demo
	# is over, so stop them too.
	for rec in "$work"/work/csi/*/*/containers/*/process.json; do
		[[ -f $rec ]] || continue
		pid=$(sed -n 's/.*"pid": \([0-9]*\).*/\1/p' "$rec")
		[[ -n $pid ]] && kill -TERM -- "-$pid" 2>/dev/null || true
	done
	rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/conf" "$work/pool"

step "csi-agent version"
$agent version

step "validate the shipped plugin configs: csi-agent check-config testdata/plugins"
$agent check-config testdata/plugins

step "a config dir with a bad file and a duplicate type: the good plugins still load, exit code 1"
cp testdata/plugins/*.json "$work/conf/"
printf '{"type": "broken.example", "containers": [{"services": ["NODE"], "command": {"value": "x"}}]}\n' >"$work/conf/broken.json"
printf '{"type": "loop.csi.csiagent.io", "endpoints": [{"csi_service": "NODE_SERVICE", "endpoint": "/run/x.sock"}]}\n' >"$work/conf/zz-duplicate.json"
rc=0
$agent check-config "$work/conf" || rc=$?
echo "exit code: $rc"
[[ $rc == 1 ]] || { echo "demo: expected exit code 1 for an invalid directory" >&2; exit 1; }
rm -f "$work"/conf/*.json

step "pre-provision a sparse 1 GiB volume: csi-loop-plugin create-volume"
"$bin/csi-loop-plugin" create-volume --pool "$work/pool" --name demo-vol --size 1GiB
du -h --apparent-size "$work/pool"/* | sed 's/^/apparent: /'
du -h "$work/pool"/* | sed 's/^/allocated: /'

step "start the daemon: csi-agent serve, with csi-loop-plugin as a managed plugin"
cat >"$work/conf/loop.json" <<JSON
{
  "type": "loop.csi.csiagent.io",
  "containers": [{
    "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
    "command": {"shell": false, "value": "$bin/csi-loop-plugin", "arguments": ["csi-loop-plugin", "--pool=$work/pool"]}
  }]
}
JSON
serve() {
	$agent serve --csi-plugin-config-dir "$work/conf" --work-dir "$work/work" --runtime-dir "$work/run" \
		--node-id demo-node --plugin-probe-interval 1s 2>>"$work/agent.log" &
	agent_pid=$!
}
serve
sock="$work/run/agent.sock"
$agent plugins --api-socket "$sock" --wait 30s
$agent plugins --api-socket "$sock" loop.csi.csiagent.io

step "a container gets the volume: csi-agent prepare (stage, publish, bind-mount into its sandbox)"
mkdir -p "$work/sandbox1" "$work/sandbox2"
cat >"$work/volumes.json" <<JSON
[{"container_path": "data", "mode": "RW",
  "source": {"type": "CSI_VOLUME", "csi_volume": {"plugin_name": "loop.csi.csiagent.io",
    "static_provisioning": {"volume_id": "demo-vol",
      "volume_capability": {"mount": {"fs_type": "ext4"}, "access_mode": {"mode": "SINGLE_NODE_MULTI_WRITER"}}}}}}]
JSON
$agent prepare --api-socket "$sock" --container demo-1 --volumes "$work/volumes.json" --sandbox "$work/sandbox1"
echo "written by demo-1 at $(date -u +%T)" >"$work/sandbox1/data/hello.txt"
$agent volumes --api-socket "$sock"
$agent containers --api-socket "$sock"

step "the container ends: csi-agent cleanup unmounts, unpublishes and unstages (last user gone)"
$agent cleanup --api-socket "$sock" --container demo-1
$agent volumes --api-socket "$sock"
echo "mounts left under the work dir: $(grep -c "$work" /proc/self/mountinfo || true)"

step "a second container reads what the first wrote"
$agent prepare --api-socket "$sock" --container demo-2 --volumes "$work/volumes.json" --sandbox "$work/sandbox2" >/dev/null
cat "$work/sandbox2/data/hello.txt"

step "live config: a bad file is reported, nothing running changes"
echo '{"type": "oops"' >"$work/conf/oops.json"
$agent plugins --api-socket "$sock" --wait 10s
sleep 1 # let the watcher's debounce pass, so the listing shows the file
$agent plugins --api-socket "$sock"
rm "$work/conf/oops.json"

step "kill -9 the agent and start a new one: the plugin process is adopted, not restarted"
before=$($agent plugins --api-socket "$sock" --output json | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -1)
kill -9 "$agent_pid"
wait "$agent_pid" 2>/dev/null || true
serve
$agent plugins --api-socket "$sock" --wait 30s
after=$($agent plugins --api-socket "$sock" --output json | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -1)
echo "plugin pid before: $before, after: $after"
[[ $before == "$after" ]] || { echo "demo: the plugin was restarted instead of adopted" >&2; exit 1; }

step "after the restart the container still has its volume; cleanup works"
cat "$work/sandbox2/data/hello.txt"
$agent cleanup --api-socket "$sock" --container demo-2
$agent volumes --api-socket "$sock"

step "SIGTERM: the agent stops cleanly (exit 0)"
kill -TERM "$agent_pid"
rc=0
wait "$agent_pid" || rc=$?
agent_pid=
echo "exit code: $rc"
tail -n 4 "$work/agent.log"
