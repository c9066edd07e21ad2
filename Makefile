# appliance: `make deploy` sets up everything and runs the main job; `make test` sets up and runs the tests.
# Idempotent: re-running a target does only what is missing. Run as root on Debian for the multi-node
# testbed (network namespaces); otherwise the testbed falls back to single-host mode and says so.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
APPLIANCE := $(VENV)/bin/appliance
HOROVOD_VERSION := $(shell sed -n 's/^horovod==//p' requirements.lock)
TF_VERSION := $(shell sed -n 's/^tensorflow_cpu==//p' requirements.lock)
# Built Horovod wheels are kept here, keyed by the TensorFlow they were built against (a rebuild takes ~5 min).
WHEEL_CACHE ?= $(HOME)/.cache/appliance/wheels/tf-$(TF_VERSION)
HOROVOD_BUILD_ENV := HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 MAKEFLAGS=-j2
DEB_PACKAGES := openssh-server openssh-client iproute2 util-linux memcached
PYTEST_ARGS ?=

.PHONY: help install system-deps deploy test test-fast clean lock bench bench-stage bench-ckpt heat-template

help:
	@echo "make deploy   install, local cloud, digits to its Swift, up 2 nodes, stage, train until the lease ends, resume, down"
	@echo "make test     install, then run every test (multi-node ones included)"
	@echo "make install  only install (.venv with the pinned stack, Debian packages for the testbed)"
	@echo "make bench    benchmarks: bench-stage (staging vs rclone/s5cmd/aws/swift), bench-ckpt (checkpoint"
	@echo "              overhead, deadline -> commit, steps lost at lease end); results in bench/results"
	@echo "make clean    remove the testbed and .venv"

install: system-deps $(VENV)/.installed

system-deps:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "note: not root, cannot install$$missing; the testbed will run in single-host mode"; fi; \
	fi

$(VENV)/.installed: requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (fix: install Python 3.11, e.g. apt-get install python3.11-venv)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	@# Everything but Horovod, exactly as locked; --no-deps keeps tf-keras from pulling in the full tensorflow wheel.
	grep -v -E '^(#|horovod==)' requirements.lock | $(PIP) install -q --no-deps -r /dev/stdin
	@# Horovod from source against the installed TensorFlow (cached as a wheel after the first build).
	@if ! ls $(WHEEL_CACHE)/horovod-$(HOROVOD_VERSION)-*.whl >/dev/null 2>&1; then \
	  echo "building horovod $(HOROVOD_VERSION) against tensorflow $(TF_VERSION) (takes ~5 min once)"; \
	  mkdir -p $(WHEEL_CACHE) && $(HOROVOD_BUILD_ENV) $(PIP) wheel -q --no-build-isolation --no-deps \
	    --no-cache-dir -w $(WHEEL_CACHE) horovod==$(HOROVOD_VERSION); fi
	$(PIP) install -q --no-deps --force-reinstall $(WHEEL_CACHE)/horovod-$(HOROVOD_VERSION)-*.whl
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/horovodrun --check-build 2>/dev/null > $(VENV)/check-build.txt
	grep -q '\[X\] TensorFlow' $(VENV)/check-build.txt || { echo "error: horovod was built without TensorFlow"; exit 1; }
	grep -q '\[X\] Gloo' $(VENV)/check-build.txt || { echo "error: horovod was built without Gloo"; exit 1; }
	touch $@

deploy: install
	$(PY) examples/digits/make_dataset.py build/digits-data
	$(APPLIANCE) data upload build/digits-data swift://digits-data/v1/ --cloud local
	@# up, stage, train; the lease ends mid-training; resume on a new lease; compare with an uninterrupted run
	$(PY) examples/lease_demo.py examples/digits.yaml
	@echo ""
	@echo "next:"
	@echo "  appliance runs                        # runs, steps, checkpoints, node-hours"
	@echo "  appliance up examples/digits.yaml     # a new lease and cluster on the local cloud"
	@echo "  appliance lease list --cloud local    # your leases"
	@echo "  appliance cloud stop                  # stop the local cloud"
	@echo "  OS_CLOUD=CHI@UC appliance up my.yaml  # the same on Chameleon (docs/chameleon.md)"

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-fast: install
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

bench/.venv-tools/.installed: bench/requirements-tools.txt
	test -x bench/.venv-tools/bin/python || $(PYTHON) -m venv bench/.venv-tools
	bench/.venv-tools/bin/pip install -q -r bench/requirements-tools.txt
	touch $@

# Staging: our stager vs rclone (swift, s3), s5cmd, aws s3 cp, swift download; bench/results/stage.{json,md,png}
bench-stage: install bench/.venv-tools/.installed
	$(PY) bench/stage_bench.py --tools-venv bench/.venv-tools

# Checkpoints: overhead (goal >= 0.98), deadline -> commit, steps lost at 20 random lease ends (goal 0)
bench-ckpt: install bench/.venv-tools/.installed
	$(PY) bench/ckpt_bench.py --tools-venv bench/.venv-tools

bench: bench-stage bench-ckpt

# The Heat template is generated from appliance/provision/{heat_boot,contextualize}.sh (one source of truth)
heat-template: install
	$(PY) -m appliance.provision.heat

lock:
	@echo "regenerating requirements.lock from .venv (check the diff)"
	{ sed -n '/^#/p' requirements.lock; $(PIP) freeze --exclude-editable | grep -v -E '^(tensorflow==|appliance)'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean:
	-test -x $(APPLIANCE) && $(APPLIANCE) testbed down
	-test -x $(APPLIANCE) && $(APPLIANCE) cloud stop
	rm -rf $(VENV) build *.egg-info
