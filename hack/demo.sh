#!/usr/bin/env bash
# make demo: csiagent at work on a fresh Linux machine, in a scratch
# directory. Everything it starts, it stops; it leaves nothing mounted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=$PWD/bin
agent=$bin/csi-agent
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

if [[ $(id -u) != 0 ]]; then
	echo "make demo mounts volumes and runs containers: run it as root" >&2
	exit 1
fi
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
	# After a failure, what is still mounted under the demo's directory
	# (innermost first) would keep it from being removed.
	{ grep " $work/" /proc/self/mountinfo || true; } | cut -d' ' -f5 | sort -r | xargs -r -n1 umount -l
	rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/conf" "$work/pool" "$work/sandbox"
sock="$work/run/agent.sock"

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
image="$work/pool/demo-vol.img"
echo "apparent size $(du -h --apparent-size "$image" | cut -f1), allocated $(du -h "$image" | cut -f1)"

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
$agent plugins --api-socket "$sock" --wait 30s
$agent plugins --api-socket "$sock" loop.csi.csiagent.io

volumes='[{"container_path": "/data", "mode": "RW", "source": {"type": "CSI_VOLUME", "csi_volume": {"plugin_name": "loop.csi.csiagent.io", "static_provisioning": {"volume_id": "demo-vol", "volume_capability": {"mount": {"fs_type": "ext4"}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}}}}}}]'
if command -v runc >/dev/null && [[ -x /bin/busybox || -x /usr/bin/busybox ]]; then
	step "a real runc container writes to the volume (OCI hooks: createRuntime prepares, poststop cleans up)"
	bundle="$work/bundle"
	mkdir -p "$bundle/rootfs/bin"
	cp "$(command -v busybox)" "$bundle/rootfs/bin/busybox"
	for a in sh echo cat ls date; do ln -s busybox "$bundle/rootfs/bin/$a"; done
	python3 - "$bundle/config.json" "$agent" "$sock" "$volumes" <<'PY'
import json, sys
path, agent, sock, volumes = sys.argv[1:]
cfg = json.load(open("testdata/oci-bundle/config.json"))
cfg["process"]["args"] = ["sh", "-c", "echo written by a runc container at $(date -u +%T) > /data/hello.txt && ls -l /data"]
cfg["annotations"]["csi.csiagent.io/volumes"] = volumes
for stage, name in (("createRuntime", "create-runtime"), ("poststop", "poststop")):
    cfg["hooks"][stage] = [{"path": agent, "args": ["csi-agent", "oci-hook", "--api-socket", sock, name], "timeout": 60}]
json.dump(cfg, open(path, "w"), indent=2)
PY
	runc run --bundle "$bundle" demo-runc
	runc delete --force demo-runc 2>/dev/null || true
	echo "after the container exited, poststop unpublished the volume:"
	$agent volumes --api-socket "$sock"
else
	step "runc is not installed: prepare into a directory instead (csi-agent prepare)"
	echo "$volumes" | sed 's|"/data"|"data"|' | $agent prepare --api-socket "$sock" --container demo-0 --volumes - --sandbox "$work/sandbox0"
	echo "written by csi-agent prepare at $(date -u +%T)" >"$work/sandbox0/data/hello.txt"
	$agent cleanup --api-socket "$sock" --container demo-0
fi

step "another container (csi-agent prepare into a sandbox) reads it back"
echo "$volumes" | sed 's|"/data"|"data"|' | $agent prepare --api-socket "$sock" --container demo-1 --volumes - --sandbox "$work/sandbox"
cat "$work/sandbox/data/hello.txt"
$agent volumes --api-socket "$sock"
$agent containers --api-socket "$sock"

if command -v podman >/dev/null && [[ -x /bin/busybox || -x /usr/bin/busybox ]]; then
	step "a Podman container reads it too, through the agent's volume plugin socket (named volume 'demo')"
	pm="$work/podman"
	mkdir -p "$pm/img/bin"
	cp "$(command -v busybox)" "$pm/img/bin/busybox"
	ln -s busybox "$pm/img/bin/cat"
	printf '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n[engine.volume_plugins]\ncsi-agent = "%s"\n' \
		"$work/run/docker-plugin.sock" >"$pm/containers.conf"
	podman_() { CONTAINERS_CONF="$pm/containers.conf" podman --root "$pm/root" --runroot "$pm/runroot" --tmpdir "$pm/tmp" "$@"; }
	tar -C "$pm/img" -c . | podman_ import -q - demo-busybox >/dev/null
	podman_ volume create --driver csi-agent -o plugin=loop.csi.csiagent.io -o volume_id=demo-vol -o fs_type=ext4 demo
	podman_ run --rm --network none --ulimit nofile=1024:4096 --ulimit nproc=1024:4096 -v demo:/data demo-busybox cat /data/hello.txt
	$agent volume ls --docker-plugin-socket "$work/run/docker-plugin.sock"
	podman_used=1
fi

step "write 128 MiB, delete it: the sparse image keeps the blocks"
dd if=/dev/urandom of="$work/sandbox/data/big" bs=1M count=128 status=none
sync
rm "$work/sandbox/data/big"
sync
echo "image allocated: $(du -h "$image" | cut -f1)"

step "csi-agent reclaim: NodeReclaimSpace trims the filesystem, the image shrinks"
$agent reclaim --api-socket "$sock" --volume demo-vol
echo "image allocated: $(du -h "$image" | cut -f1)"

step "live config: a bad file is reported, nothing running changes"
echo '{"type": "oops"' >"$work/conf/oops.json"
sleep 1 # the watcher debounces bursts of writes
$agent plugins --api-socket "$sock"
rm "$work/conf/oops.json"

step "kill -9 the agent and start a new one: the plugin process is adopted, the container keeps its volume"
before=$($agent plugins --api-socket "$sock" --output json | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -1)
kill -9 "$agent_pid"
wait "$agent_pid" 2>/dev/null || true
serve
$agent plugins --api-socket "$sock" --wait 30s
after=$($agent plugins --api-socket "$sock" --output json | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -1)
echo "plugin pid before: $before, after: $after"
[[ $before == "$after" ]] || { echo "demo: the plugin was restarted instead of adopted" >&2; exit 1; }
cat "$work/sandbox/data/hello.txt"

step "cleanup: unmount, unpublish, unstage; nothing left mounted"
$agent cleanup --api-socket "$sock" --container demo-1
if [[ -n ${podman_used:-} ]]; then
	# The name can go once no container uses its volume.
	podman_ volume rm demo >/dev/null
	podman_ rmi -a -f >/dev/null 2>&1 || true
	{ grep " $pm/" /proc/self/mountinfo || true; } | cut -d' ' -f5 | sort -r | xargs -r -n1 umount -l
fi
$agent volumes --api-socket "$sock"
echo "mounts left under $work: $(grep -c "$work" /proc/self/mountinfo || true)"

step "SIGTERM: the agent stops cleanly (exit 0)"
kill -TERM "$agent_pid"
rc=0
wait "$agent_pid" || rc=$?
agent_pid=
echo "exit code: $rc"
