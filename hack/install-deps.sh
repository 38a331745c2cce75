#!/usr/bin/env bash
# Installs the Debian packages the tests and the demo need, when a command
# they provide is missing. Safe to run again: it installs nothing when all
# are present. Needs root (or sudo) only when something is missing.
set -euo pipefail

# command -> Debian package
declare -A want=(
	[mkfs.ext4]=e2fsprogs
	[e2fsck]=e2fsprogs
	[mkfs.xfs]=xfsprogs
	[losetup]=util-linux
	[blkid]=util-linux
	[protoc]=protobuf-compiler
	[runc]=runc
	[systemd-analyze]=systemd
	[debugfs]=e2fsprogs
	# The whole-daemon crash-state test records the daemon's file-system
	# operations (integration TestCrashStates).
	[strace]=strace
	# The container engine tests (package integration) run real engines.
	[dockerd]=docker.io
	[podman]=podman
	# TestDockerCallsWaitForAgentRestart reads a socket's backlog.
	[ss]=iproute2
)
missing=()
for cmd in "${!want[@]}"; do
	if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1; then
		missing+=("${want[$cmd]}")
	fi
done
[[ -f /usr/include/google/protobuf/descriptor.proto ]] || missing+=(libprotobuf-dev)
# The OCI tests' containers run a static busybox.
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed" || missing+=(busybox-static)
((${#missing[@]})) || exit 0

mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "install-deps: installing Debian packages: ${pkgs[*]}" >&2
sudo=()
[[ "$(id -u)" == 0 ]] || sudo=(sudo)
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
