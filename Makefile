# csiagent build, test and demo. `make help` lists the targets.

SHELL        := /bin/bash
GO           ?= go
VERSION      ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS      := -X github.com/csiagent/csiagent/internal/version.Version=$(VERSION)
TOOLS_BIN    := $(CURDIR)/.tools/bin
STATICCHECK_VERSION := v0.8.2
FUZZTIME     ?= 10s
BINARIES     := $(patsubst cmd/%/main.go,%,$(wildcard cmd/*/main.go))

PREFIX       ?= /usr/local
DESTDIR      ?=
UNITDIR      ?= /etc/systemd/system

.PHONY: help build install test fuzz lint proto check-proto demo deps clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## build bin/csi-agent and bin/csi-loop-plugin with the version injected
	@mkdir -p bin
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/ $(addprefix ./cmd/,$(BINARIES))

install: build ## install the binaries to $(PREFIX)/bin and the systemd unit to $(UNITDIR) (DESTDIR honoured)
	install -D -m 0755 bin/csi-agent $(DESTDIR)$(PREFIX)/bin/csi-agent
	install -D -m 0755 bin/csi-loop-plugin $(DESTDIR)$(PREFIX)/bin/csi-loop-plugin
	install -D -m 0644 deploy/csi-agent.service $(DESTDIR)$(UNITDIR)/csi-agent.service
	sed -i 's|/usr/local/bin/csi-agent|$(PREFIX)/bin/csi-agent|' $(DESTDIR)$(UNITDIR)/csi-agent.service
	install -d -m 0755 $(DESTDIR)/etc/csi-agent/plugins.d
	@echo "installed; run: systemctl daemon-reload && systemctl enable --now csi-agent"

deps: ## install the Debian packages the tests need (e2fsprogs, xfsprogs, util-linux, protoc, runc, busybox-static, systemd)
	bash hack/install-deps.sh

test: deps ## run every test (root tests included when run as root) and a short fuzz
	$(GO) test -race -count=1 ./...
	$(MAKE) --no-print-directory fuzz

fuzz: ## run each fuzz target for FUZZTIME (default 10s)
	$(GO) test -run='^$$' -fuzz='^FuzzParse$$' -fuzztime=$(FUZZTIME) ./pluginconfig

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
