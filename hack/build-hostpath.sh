#!/usr/bin/env bash
# Builds bin/hostpathplugin (the third-party CSI hostpath driver used by tests)
# from the vendored source in third_party/csi-driver-host-path. That directory
# is its own Go module; its dependencies come from the Go module proxy only.
# The build is skipped when bin/hostpathplugin is newer than every file under
# third_party/csi-driver-host-path (and than this script).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/third_party/csi-driver-host-path"
OUT="$ROOT/bin/hostpathplugin"
# Upstream release the source was taken from; shown by GetPluginInfo
# (the driver refuses GetPluginInfo when main.version is empty).
HOSTPATH_VERSION="${HOSTPATH_VERSION:-v1.18.0}"

if [[ -x "$OUT" ]] \
	&& [[ -z "$(find "$SRC" -newer "$OUT" -print -quit)" ]] \
	&& [[ ! "${BASH_SOURCE[0]}" -nt "$OUT" ]]; then
	echo "build-hostpath: $OUT is up to date"
	exit 0
fi

mkdir -p "$ROOT/bin"
echo "build-hostpath: building $OUT (csi-driver-host-path $HOSTPATH_VERSION)"
cd "$SRC"
# GOWORK=off and -mod=readonly: build exactly what go.mod/go.sum pin, even if a
# go.work or GOFLAGS=-mod=vendor is present in the caller's environment.
GOWORK=off CGO_ENABLED=0 go build -mod=readonly -buildvcs=false -trimpath \
	-ldflags "-X main.version=$HOSTPATH_VERSION" \
	-o "$OUT.tmp" ./cmd/hostpathplugin
mv -f "$OUT.tmp" "$OUT"
echo "build-hostpath: built $OUT"
