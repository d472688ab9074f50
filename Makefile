# Kiln. On a fresh Debian machine: `make` (set up, build, boot a demo
# sandbox), then `make test`. See README.md.

SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Debian packages the build, the demo and the tests use (debootstrap makes
# the image tests' Debian root, tools/build-test-rootfs.sh). QEMU comes at
# version 10 or newer (tools/install-qemu.sh: bookworm-backports on Debian
# 12): it emulates the test harness's L1 VMs and is the benchmarks' peer.
# systemd brings systemd-analyze, which verifies packaging/'s units;
# iproute2 the ip the network tests make their namespaces with; containerd
# (with ctr) and the CNI plugins the containerd shim's tests start
# containerd and its CRI plugin with.
DEB_PACKAGES := qemu-system-x86 busybox-static cpio acpica-tools e2fsprogs erofs-utils kmod xz-utils debootstrap systemd iproute2 git python3-pytest containerd containernetworking-plugins

# crictl (cri-tools), pinned: the shim's CRI test drives containerd with
# it. Debian 12 has no package of it; go install builds it into bin/.
CRICTL_VERSION := v1.37.0

# E2B's Python SDK for its suite (daemon/e2b/pysdktest): the version
# pysdk_test.go wants, the venv it runs pytest with, and the script that
# makes it (../shared/fixtures/e2b-python: Debian's python3 and pytest).
E2B_PY_VERSION := 2.34.0
E2B_PY_VENV := daemon/e2b/pysdktest/.venv
E2B_PY_SETUP := ../shared/fixtures/e2b-python/setup.sh

KILN := bin/kiln
VMM := bin/kiln-vmm
AGENT := bin/kiln-agent
HARNESS := bin/kvmharness

# Flags for the test harness, e.g. `make test HARNESS_FLAGS=-mode=tcg`.
HARNESS_FLAGS ?=
# How many times make test runs the suite before it fails (see README).
HARNESS_TRIES ?= 1

# make demo: boot a sandbox (Debian's kernel, the guest agent as init) and
# run a command in it, printing its output and the times. The harness runs
# it directly where /dev/kvm works and in an emulated L1 VM (QEMU TCG) where
# it does not.
DEMO_CMD = $(KILN) run --time --boot-timeout 4m -- sh -c 'uname -a; echo hello from kiln'
DEMO_TIMEOUT := 5m

.PHONY: all deps build harness kernel guest-kernel test-rootfs demo test soak fuzz bench clean install

all: deps build kernel demo

# Install the Debian packages that are missing. Go is expected at
# /usr/local/go or on PATH.
deps:
	@missing=; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@tools/install-qemu.sh
	@command -v $(GO) >/dev/null || { echo "deps: no Go: install Go 1.26 in /usr/local/go"; exit 1; }
	@# The E2B SDK the suite drives kilnd with (daemon/e2b/sdktest), pinned
	@# by its lockfile; Node and npm from Debian's packages when missing.
	@command -v node >/dev/null && command -v npm >/dev/null || { \
	  echo "deps: installing nodejs npm"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm; }
	@node -e 'const [a,b,c]=process.versions.node.split(".").map(Number); process.exit(a>=22||(a===20&&(b>18||(b===18&&c>=1)))?0:1)' || { \
	  echo "deps: node $$(node --version) is too old for the e2b SDK (it needs 20.18.1 or newer, as its package.json says; Debian 12's nodejs is 18): install a newer Node.js"; exit 1; }
	cd daemon/e2b/sdktest && npm ci --no-audit --no-fund
	@# E2B's Python SDK, pinned, in a venv for daemon/e2b/pysdktest: made
	@# by the shared fixture's setup.sh (Debian's packages and the SDK's
	@# pure-Python releases: PyPI is out of reach), again when the venv
	@# holds another version.
	@$(E2B_PY_VENV)/bin/python -c 'import sys, pytest, importlib.metadata as m; sys.exit(m.version("e2b") != "$(E2B_PY_VERSION)")' 2>/dev/null || { \
	  [ -x $(E2B_PY_SETUP) ] || { echo "deps: no $(E2B_PY_SETUP) (the shared fixtures): it makes the venv of E2B's Python SDK"; exit 1; }; \
	  echo "deps: E2B's Python SDK $(E2B_PY_VERSION) into $(E2B_PY_VENV)"; \
	  rm -rf $(E2B_PY_VENV) && $(SUDO) $(E2B_PY_SETUP) $(E2B_PY_VENV) && \
	  { [ -z "$(SUDO)" ] || $(SUDO) chown -R $$(id -u):$$(id -g) $(E2B_PY_VENV); }; }
	@[ -x bin/crictl ] && bin/crictl --version 2>/dev/null | grep -q "$(CRICTL_VERSION)" || { \
	  echo "deps: go install sigs.k8s.io/cri-tools/cmd/crictl@$(CRICTL_VERSION)"; \
	  GOBIN=$$(pwd)/bin CGO_ENABLED=0 $(GO) install sigs.k8s.io/cri-tools/cmd/crictl@$(CRICTL_VERSION); }

# kiln-vmm (the VMM process every sandbox runs: package vmmproc, not the
# CLI) without cgo: a jailed VMM process (package jail) changes every
# thread's ids and capabilities through the Go runtime, which it cannot do
# in a cgo binary. kiln and kilnd find it beside themselves.
build: harness
	CGO_ENABLED=0 $(GO) build -o $(KILN) ./cmd/kiln
	CGO_ENABLED=0 $(GO) build -o $(VMM) ./cmd/kiln-vmm
	CGO_ENABLED=0 $(GO) build -o bin/kilnd ./cmd/kilnd
	CGO_ENABLED=0 $(GO) build -trimpath -o $(AGENT) ./cmd/kiln-agent
	@# The guest echo program of kiln bench devices (found beside kiln).
	CGO_ENABLED=0 $(GO) build -trimpath -o bin/kiln-vsockecho ./internal/testguest/vsockecho
	CGO_ENABLED=0 $(GO) build -o bin/containerd-shim-kiln-v2 ./cmd/containerd-shim-kiln-v2

harness:
	$(GO) build -o $(HARNESS) ./tools/kvmharness

# Debian's stock kernel, into $KILN_CACHE or ~/.cache/kiln (once).
kernel:
	tools/fetch-kernel.sh

# Optional: a minimal kernel built from Debian's linux-source-6.1 with
# configs/guest-kernel.config (about 20 minutes on two cores), for the
# cold-start figures. Lands in <cache>/guest-kernel/current.
guest-kernel:
	tools/build-guest-kernel.sh

# The image tests' Debian minbase root with python3 and git (debootstrap,
# about a minute, once): <cache>/test-rootfs/.
test-rootfs:
	@tools/build-test-rootfs.sh >/dev/null

demo: build kernel
	$(HARNESS) -exec -timeout $(DEMO_TIMEOUT) -l1-timeout 10m -- $(DEMO_CMD)

test: harness test-rootfs
	@unformatted=$$(gofmt -l .); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	@for try in $$(seq 1 $(HARNESS_TRIES)); do \
	  $(HARNESS) $(HARNESS_FLAGS) ./... && exit 0; \
	  [ $$try -lt $(HARNESS_TRIES) ] && echo "make test: the suite failed (try $$try of $(HARNESS_TRIES)); running it again: Linux boots in L2 under TCG-nested KVM are occasionally flaky (see README)"; \
	done; exit 1

# The load tests at the sizes make test keeps small: 100 concurrent
# creates from a template through kilnd (TestKVMDaemonTemplates, 12 in
# make test) and 64 restore/close cycles of VMM processes, each counted for
# leaks (TestKVMSandboxSoak, 16 in make test). Not part of CI.
SOAK_STORM ?= 100
SOAK_CYCLES ?= 64
soak: harness test-rootfs
	KILN_TEMPLATE_STORM=$(SOAK_STORM) KILN_SOAK_CYCLES=$(SOAK_CYCLES) \
	  $(HARNESS) $(HARNESS_FLAGS) -timeout 60m -run 'TestKVMDaemonTemplates$$|TestKVMSandboxSoak$$' ./daemon ./sandbox

# Every fuzz target, briefly: the parsers of guest- and user-written input
# (virtqueues, device requests, kernel images, flags). make test runs only
# their seed corpora (go test does); this explores, and CI does not run it:
# `make fuzz FUZZTIME=10m` runs longer. FUZZMINTIME bounds each minimisation
# (of a failing input, and of each new interesting one: up to 60s each by
# default, during which nothing new is tried), so that it cannot eat the
# budget. Each package's instrumented test binary is built once (go test -c
# -fuzz) and runs each of its targets in the package's folder (seeds in
# testdata/fuzz, the corpus in go test's own cache folder), instead of a go
# test -fuzz per target that links it again each time; the targets are
# found in the test files' source, without building a test binary of every
# package to list them.
# FUZZTIMEOUT kills a target that runs on past it (raise it with FUZZTIME);
# FUZZPKGS narrows the run to some packages.
FUZZTIME ?= 4s
FUZZMINTIME ?= 5s
FUZZTIMEOUT ?= 20m
FUZZPKGS ?= ./...
fuzz:
	@set -e; bindir=$$(mktemp -d); trap 'rm -rf "$$bindir"' EXIT; \
	cache=$$($(GO) env GOCACHE)/fuzz; \
	for pd in $$($(GO) list -f '{{.ImportPath}}={{.Dir}}' $(FUZZPKGS)); do \
	  pkg=$${pd%%=*}; dir=$${pd#*=}; \
	  targets=$$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$$dir"/*_test.go 2>/dev/null || true); \
	  [ -n "$$targets" ] || continue; \
	  bin=$$bindir/$$(echo $$pkg | tr / _).test; \
	  $(GO) test -c -fuzz=. -o "$$bin" $$pkg; \
	  for f in $$targets; do \
	    echo "fuzz: $$pkg $$f ($(FUZZTIME), minimising at most $(FUZZMINTIME))"; \
	    log=$$bindir/log; \
	    if ! (cd "$$dir" && "$$bin" -test.run '^$$' -test.fuzz "^$$f\$$" -test.fuzztime $(FUZZTIME) -test.fuzzminimizetime $(FUZZMINTIME) -test.timeout $(FUZZTIMEOUT) -test.fuzzcachedir "$$cache/$$pkg") >$$log 2>&1; then \
	      tail -20 $$log; \
	      if grep -q 'Failing input written to' $$log; then \
	        echo "fuzz: $$f found a failing input (above); rerun: go test -run '^$$' -fuzz '^$$f$$' $$pkg"; exit 1; \
	      fi; \
	      echo "fuzz: warning: $$f stopped without a failing input (above), not counted as a failure"; \
	    fi; \
	  done; \
	done

# make bench: the benchmark suites where KVM works (this machine's, or an
# emulated L1's through the harness: it runs the command directly where
# /dev/kvm is usable, in an L1 VM under QEMU TCG where it is not), each
# measure beside QEMU microvm in the same run, alternating; one harness
# run (one L1 boot) per suite, in BENCH_SUITES's order. Each suite writes
# its results file (JSON: machine, kernel, commit, KVM mode, every sample)
# to $(BENCH_OUT)/SUITE.json (a suite that fails leaves none, and make
# bench fails after the others ran); then `kiln bench report` makes the
# tables (tables.md) and SVG plots of every results file in $(BENCH_OUT),
# earlier runs' of other suites included. Then the package benchmarks that
# need no KVM. A subset: make bench BENCH_SUITES="boot devices". The
# flags are sized for emulated KVM (docs/bench.md: about 19 minutes with
# the minimal kernel built, and about 20 more for daemon); where KVM is
# direct, larger ones fit, e.g.
# make bench BENCH_FLAGS_snapshot="-n 10 --boots 5".
BENCH_OUT ?= bench-out
BENCH_RUNS ?= 5
BENCH_ALL := boot start devices snapshot density daemon
BENCH_SUITES ?= $(BENCH_ALL)
BENCH_TIMEOUT ?= 60m
BENCH_L1_TIMEOUT ?= 65m
BENCH_FLAGS_boot ?= -n $(BENCH_RUNS)
BENCH_FLAGS_start ?= -n $(BENCH_RUNS)
BENCH_FLAGS_devices ?= -n $(BENCH_RUNS)
BENCH_FLAGS_snapshot ?= -n 3 --boots 2 --mem 256,512 --base 512 --forks 1,8 --pss-fork 8
BENCH_FLAGS_density ?= --mem 512 --children 32
BENCH_FLAGS_daemon ?= --concurrency 1,10 --samples 5 --pool 2 --rate-for 30s --rate-workers 2 --fork 1,8 --checkpoints 3 --mem 128
# The shell case that picks each suite's flags.
rparen := )
bench_flags_case = $(foreach s,$(BENCH_ALL),$(s)$(rparen) flags='$(BENCH_FLAGS_$(s))';;)
bench: build harness kernel test-rootfs
	@mkdir -p $(BENCH_OUT)
	@for s in $(BENCH_SUITES); do case " $(BENCH_ALL) " in *" $$s "*) ;; \
	  *) echo "make bench: no suite $$s (BENCH_SUITES takes $(BENCH_ALL))"; exit 2;; esac; done
	@failed=; for s in $(BENCH_SUITES); do \
	  case $$s in $(bench_flags_case) esac; \
	  rm -f $(BENCH_OUT)/$$s.json; \
	  echo "make bench: $$s ($$(date +%T)): kiln bench $$s $$flags"; \
	  $(HARNESS) -exec -shared $(abspath $(BENCH_OUT)) -timeout $(BENCH_TIMEOUT) -l1-timeout $(BENCH_L1_TIMEOUT) -- \
	    sh -c "$(KILN) bench $$s $$flags --json \"\$$KILN_TEST_SHARED/$$s.json\"" || failed="$$failed $$s"; \
	done; \
	if ls $(BENCH_OUT)/*.json >/dev/null 2>&1; then \
	  $(KILN) bench report -o $(BENCH_OUT) $(BENCH_OUT)/*.json || failed="$$failed report"; \
	fi; \
	if [ -n "$$failed" ]; then echo "make bench: failed:$$failed (see above)"; exit 1; fi
	$(GO) test -run '^$$' -bench . ./bench/...

# make install [PREFIX=/usr/local] [DESTDIR=]: kiln, kilnd, kiln-vmm and
# kiln-agent side by side in $(BINDIR) (kiln and kilnd find the agent and
# the VMM beside themselves), kilnd's systemd units (ExecStart pointed at $(BINDIR)), and
# /etc/kiln/kilnd.toml unless one is there, and /etc/tmpfiles.d/kiln.conf
# (shmem huge pages where advised, from the next boot). Then: systemctl daemon-reload;
# systemctl enable --now kilnd.socket kilnd.service (README).
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
UNITDIR ?= $(SYSCONFDIR)/systemd/system
KILND ?= bin/kilnd
install: build
	install -d -m 0755 $(DESTDIR)$(BINDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSCONFDIR)/kiln
	install -m 0755 $(KILN) $(DESTDIR)$(BINDIR)/kiln
	install -m 0755 $(KILND) $(DESTDIR)$(BINDIR)/kilnd
	install -m 0755 $(VMM) $(DESTDIR)$(BINDIR)/kiln-vmm
	install -m 0755 $(AGENT) $(DESTDIR)$(BINDIR)/kiln-agent
	sed -e 's|/usr/local/bin/kilnd|$(BINDIR)/kilnd|g' -e 's|/etc/kiln/|$(SYSCONFDIR)/kiln/|g' packaging/kilnd.service > $(DESTDIR)$(UNITDIR)/kilnd.service.tmp
	chmod 0644 $(DESTDIR)$(UNITDIR)/kilnd.service.tmp && mv $(DESTDIR)$(UNITDIR)/kilnd.service.tmp $(DESTDIR)$(UNITDIR)/kilnd.service
	install -m 0644 packaging/kilnd.socket $(DESTDIR)$(UNITDIR)/kilnd.socket
	install -d -m 0755 $(DESTDIR)$(SYSCONFDIR)/tmpfiles.d
	install -m 0644 packaging/kiln-tmpfiles.conf $(DESTDIR)$(SYSCONFDIR)/tmpfiles.d/kiln.conf
	@if [ -e $(DESTDIR)$(SYSCONFDIR)/kiln/kilnd.toml ]; then \
	  echo "install: keeping $(DESTDIR)$(SYSCONFDIR)/kiln/kilnd.toml (packaging/kilnd.toml is the current default)"; \
	else \
	  install -m 0644 packaging/kilnd.toml $(DESTDIR)$(SYSCONFDIR)/kiln/kilnd.toml; \
	fi

clean:
	rm -rf bin
