#!/usr/bin/env bash
# Fails when the generated Go code under proto/ is not exactly what
# hack/gen-proto.sh would produce from the .proto sources: out-of-date,
# missing or stale *.pb.go files. The working tree is never modified; the code
# is regenerated into a temporary directory and compared byte for byte.
set -euo pipefail

exec "$(dirname "${BASH_SOURCE[0]}")/gen-proto.sh" --check
