# csiagent build, test and demo. `make help` lists the targets.

SHELL        := /bin/bash
GO           ?= go
VERSION      ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS      := -X github.com/csiagent/csiagent/internal/version.Version=$(VERSION)
TOOLS_BIN    := $(CURDIR)/.tools/bin
STATICCHECK_VERSION := v0.8.2
# A count of executions per fuzz target, not a duration: Go 1.26's fuzz
# coordinator can fail a duration run at its end with a bare "context
# deadline exceeded" and no failing input (golang/go#75804, fixed in Go
# 1.27); a count has no deadline to race. 10000x: 1 to 10 s a target here.
FUZZTIME     ?= 10000x
# bounds each fuzz target's whole run (its seed corpus, then FUZZTIME
# executions)
FUZZ_TIMEOUT ?= 10m
# Fuzz targets that start a whole isolator or a bundle per input (tens of
# executions a second: FUZZTIME's count would take them minutes), so make
# test runs only their seed corpora (with go test); make fuzz runs them
# too.
FUZZ_SLOW    := FuzzCheckpointDecode FuzzOCIHookInput
# End-to-end packages (integration: the daemon with runc, loop devices,
# crashes, the soak and the container engines; integration/fleet: three
# agents on a real etcd, a package apart so that it runs beside
# integration; bench) drive the built
# binaries (agent, plugins, engines) as child processes and run whole
# daemons for a minute and more: under the race detector they would take
# many minutes, so make test runs them without -race. Every other
# package, including the root ones that run our mount and supervision
# code in-process, runs with -race.
E2E_PKGS     := ./integration ./integration/fleet ./bench
# BESIDE_E2E: packages of the race set that make no mount, mount namespace
# or loop device (./cluster: embedded etcd clusters, a minute and a half
# of waiting on leases and elections), run with -race beside the
# end-to-end packages instead of before them.
BESIDE_E2E   := ./cluster
# SUBMAKE is $(MAKE) under a name make -n does not run recipes for (the
# end-to-end line would run the tests).
SUBMAKE      = $(MAKE)
TEST_TIMEOUT ?= 9m
# make unit: per test binary; its packages finish in seconds each.
UNIT_TIMEOUT ?= 2m
DURATION     ?= 10m
SOAK_TIMEOUT ?= 3h
SOAK_LOG     ?= /tmp/csiagent-soak.log
CLUSTER_SOAK_LOG ?= /tmp/csiagent-cluster-soak.log
# make powercut: random disk states per cut point, besides the systematic ones
CUTS         ?= 20
# make powercut: crash states of the whole daemon (make test recovers 60)
CRASH_STATES ?= 1000
POWERCUT_LOG ?= /tmp/csiagent-powercut.log
BINARIES     := $(patsubst cmd/%/main.go,%,$(wildcard cmd/*/main.go))

PREFIX       ?= /usr/local
DESTDIR      ?=
UNITDIR      ?= /etc/systemd/system

.PHONY: help build install unit test bench fuzz soak cluster-soak powercut lint proto check-proto demo deps hostpathplugin clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## build bin/csi-agent and bin/csi-loop-plugin with the version injected
	@mkdir -p bin
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/ $(addprefix ./cmd/,$(BINARIES))

install: build ## install the binaries to $(PREFIX)/bin, the systemd unit and its socket units to $(UNITDIR), the Podman/CRI-O hook, the Docker plugin spec, Podman's containers.conf.d drop-in and, unless there is one, the loop plugin's config (DESTDIR honoured)
	install -D -m 0755 bin/csi-agent $(DESTDIR)$(PREFIX)/bin/csi-agent
	install -D -m 0755 bin/csi-loop-plugin $(DESTDIR)$(PREFIX)/bin/csi-loop-plugin
	install -D -m 0644 deploy/csi-agent.service $(DESTDIR)$(UNITDIR)/csi-agent.service
	sed -i 's|/usr/local/bin/csi-agent|$(PREFIX)/bin/csi-agent|' $(DESTDIR)$(UNITDIR)/csi-agent.service
	install -m 0644 deploy/csi-agent-api.socket deploy/csi-agent-docker-plugin.socket $(DESTDIR)$(UNITDIR)/
	install -d -m 0755 $(DESTDIR)/etc/csi-agent/plugins.d
	@# The bundled loop plugin, unless a loop.json is there already (an
	@# edited one is kept); remove it if this host has no use for it.
	[ -e $(DESTDIR)/etc/csi-agent/plugins.d/loop.json ] || sed 's|/usr/local/bin/|$(PREFIX)/bin/|' testdata/plugins/loop.json > $(DESTDIR)/etc/csi-agent/plugins.d/loop.json
	install -D -m 0644 deploy/oci-hooks.d/csi-agent.json $(DESTDIR)/usr/share/containers/oci/hooks.d/csi-agent.json
	sed -i 's|/usr/local/bin/csi-agent|$(PREFIX)/bin/csi-agent|' $(DESTDIR)/usr/share/containers/oci/hooks.d/csi-agent.json
	install -D -m 0644 deploy/docker-plugins/csi-agent.spec $(DESTDIR)/etc/docker/plugins/csi-agent.spec
	install -D -m 0644 deploy/containers.conf.d/csi-agent.conf $(DESTDIR)/etc/containers/containers.conf.d/csi-agent.conf
	@echo "installed; run: systemctl daemon-reload && systemctl enable --now csi-agent"

deps: ## install the Debian packages the tests need (e2fsprogs, xfsprogs, util-linux, protoc, runc, busybox-static, systemd, docker.io, podman) and build bin/hostpathplugin
	bash hack/install-deps.sh
	bash hack/build-hostpath.sh

hostpathplugin: ## build bin/hostpathplugin, csi-driver-host-path from third_party/ (a third-party plugin the tests run)
	bash hack/build-hostpath.sh

test: deps ## run every test (root tests included when run as root; TestSoak is a 15s smoke) and a short fuzz
	@race=$$($(GO) list ./... | grep -vxF -f <($(GO) list $(E2E_PKGS) $(BESIDE_E2E))); \
		echo "$$(date +%T) the race set: every package but the end-to-end ones ($(E2E_PKGS)) and $(BESIDE_E2E)"; \
		$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $$race
	@# ./integration, the longest, beside the others one after the other
	@# and then the fuzz targets: two at a time, as -p 2 ran them; and
	@# BESIDE_E2E, with -race, beside them all. Not beside the race set:
	@# its root tests make mount namespaces, which hold copies of the
	@# end-to-end tests' mounts (and theirs of the race set's), so volumes
	@# are "still mounted elsewhere" and loop devices stay attached.
	@echo "$$(date +%T) the end-to-end packages ($(E2E_PKGS)), then fuzz; beside them $(BESIDE_E2E) (-race)"
	@$(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./integration & integration=$$!; \
		$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(BESIDE_E2E) & beside=$$!; \
		$(GO) test -p 1 -count=1 -timeout $(TEST_TIMEOUT) $(filter-out ./integration,$(E2E_PKGS)); rc=$$?; \
		if [ $$rc -eq 0 ]; then echo "$$(date +%T) fuzz"; $(SUBMAKE) --no-print-directory fuzz FUZZ_SKIP="$(FUZZ_SLOW)" || rc=$$?; fi; \
		wait $$beside || rc=$$?; wait $$integration || rc=$$?; exit $$rc
	@echo "$$(date +%T) make test done"

unit: ## the fast tests while editing: every package but the end-to-end ones, -race and -short (root tests, and the few slow ones, skip themselves; make test runs them); go test's cache reruns only what changed
	$(GO) test -short -race -timeout $(UNIT_TIMEOUT) $$($(GO) list ./... | grep -vxF -f <($(GO) list $(E2E_PKGS)))

bench: ## (root) run the performance benchmarks at full size (~3 min), print the table and write bench/results.md; see docs/benchmarks.md
	$(GO) test -count=1 -v -timeout 30m ./bench -args -full -out $(CURDIR)/bench/results.md
	$(GO) test -count=1 -v -timeout 10m -run TestDockerRunOverhead ./integration -args -engine-pairs 20

fuzz: ## run every fuzz target (each `func Fuzz*` in a *_test.go) for FUZZTIME each (default 3s)
	@set -e; for file in $$(grep -rlE --include='*_test.go' --exclude-dir=.tools --exclude-dir=.git '^func Fuzz[A-Za-z0-9_]*\(' . | sort); do \
		dir=$$(dirname $$file); \
		for fn in $$(sed -nE 's/^func (Fuzz[A-Za-z0-9_]*)\(.*/\1/p' $$file); do \
			case " $(FUZZ_SKIP) " in *" $$fn "*) echo "fuzz: $$dir $$fn skipped here (seed corpus ran with go test)"; continue;; esac; \
			echo "fuzz: $$dir $$fn for $(FUZZTIME)"; \
			$(GO) test -timeout $(FUZZ_TIMEOUT) -run='^$$' -fuzz="^$$fn\$$" -fuzztime=$(FUZZTIME) $$dir; \
		done; \
	done

soak: deps ## (root) random prepares/cleanups/reclaims with agent and plugin SIGKILLs on loop volumes for DURATION (default 10m); prints its figures, full log in SOAK_LOG
	@echo "soak: $(DURATION), full log in $(SOAK_LOG)"
	@CSIAGENT_SOAK_DURATION=$(DURATION) $(GO) test -count=1 -timeout=$(SOAK_TIMEOUT) -run='^TestSoak$$' -v ./integration >$(SOAK_LOG) 2>&1; rc=$$?; \
		grep -E '^soak: |invariant violation|^(--- |ok|FAIL)' $(SOAK_LOG); exit $$rc

cluster-soak: deps ## (root) three agents on a real 3-member etcd: random prepares and cleanups on every host with agent SIGKILLs and etcd member kills for DURATION (default 10m); prints its figures, full log in CLUSTER_SOAK_LOG
	@echo "cluster soak: $(DURATION), full log in $(CLUSTER_SOAK_LOG)"
	@CSIAGENT_CLUSTER_SOAK_DURATION=$(DURATION) $(GO) test -count=1 -timeout=$(SOAK_TIMEOUT) -run='^TestClusterSoak$$' -v ./integration/fleet >$(CLUSTER_SOAK_LOG) 2>&1; rc=$$?; \
		grep -E '^cluster soak: |invariant violation|^(--- |ok|FAIL)' $(CLUSTER_SOAK_LOG); exit $$rc

powercut: deps ## (root) the whole daemon's crash states (CRASH_STATES, default 1000; make test recovers 60) and TestPowerCut with CUTS random disk states per cut point (default 20; make test runs 2); prints the summaries, full log in POWERCUT_LOG
	@$(GO) test -count=1 -timeout=60m -run='^TestCrashStates$$' -v ./integration -args -crash-states=$(CRASH_STATES) >$(POWERCUT_LOG) 2>&1; rc=$$?; \
		$(GO) test -count=1 -timeout=30m -run='^TestPowerCut$$' -v ./isolator -args -powercut.mixes=$(CUTS) >>$(POWERCUT_LOG) 2>&1 || rc=$$?; \
		grep -E '^crash states: |power cut: |^(--- |ok|FAIL)' $(POWERCUT_LOG); exit $$rc

lint: ## gofmt, go vet and staticcheck (pinned)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt: not formatted:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	@[ -x $(TOOLS_BIN)/staticcheck ] && $(TOOLS_BIN)/staticcheck -version | grep -q '$(STATICCHECK_VERSION:v%=%)' || \
		GOFLAGS= GOBIN=$(TOOLS_BIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	$(TOOLS_BIN)/staticcheck ./...

proto: ## regenerate the Go code of every .proto under proto/ (pinned generators)
	bash hack/gen-proto.sh

check-proto: ## fail if the checked-in generated code differs from a regeneration
	bash hack/check-proto.sh

demo: build deps ## build, then run csiagent end to end on this machine (as root)
	bash hack/demo.sh

clean: ## remove build outputs
	rm -rf bin
