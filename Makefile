# appliance: `make deploy` sets up everything and runs the main job; `make test` sets up and runs the tests.
# Idempotent: re-running a target does only what is missing. Run as root on Debian for the multi-node
# testbed (network namespaces); otherwise the testbed falls back to single-host mode and says so.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
APPLIANCE := $(VENV)/bin/appliance
# Built Horovod wheels are kept here, by TensorFlow version, variant and Python (a rebuild takes ~5 min).
WHEEL_CACHE ?= $(HOME)/.cache/appliance/wheels
DEB_PACKAGES := openssh-server openssh-client iproute2 util-linux memcached shellcheck curl sudo
# Ceph's RADOS Gateway, the local cloud's object store as on Chameleon (appliance/localcloud/rgw_server.py)
CEPH_PACKAGES := ceph-mon ceph-osd radosgw ceph-common
PYTEST_ARGS ?=
# Python writes its bytecode caches (__pycache__) here: where the environment says not to (PYTHONDONTWRITEBYTECODE,
# as some containers set it), every process that imports the appliance from this checkout (the CLI, node agents,
# ranks on the testbed's nodes) and each pytest worker's assertion rewriting would compile the sources anew, every
# time. Ranks still write none (appliance/protocol.py BASE_RANK_ENV); they read what is there.
unexport PYTHONDONTWRITEBYTECODE
# A Python 3.12 (what a CC-Ubuntu24.04 node runs; Debian 12 has none): the local cloud's 24.04 nodes run it, and
# make install builds Horovod for it once (testbed/nodeimage.py PYTHON312_AT looks in the same places)
PYTHON312 ?= $(firstword $(wildcard /usr/bin/python3.12 /usr/local/bin/python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12))
# `make test` runs the tests in a few processes (pytest-xdist): one more than the cores, at most 4. An end-to-end
# test keeps 0.87 of a core busy on average (it waits on boots, stores, lease ends and jobs' launches), so with one
# worker per core a core idles; another worker's test fills it. Each test file runs whole in one worker (--dist
# loadfile), so its fixtures (a local cloud, a store, a reference run) are made once; the longest files first
# (tests/conftest.py LONGEST_FIRST; --no-loadscope-reorder keeps that order). Here (2 cores), from a fresh clone:
# 3 workers 19:07 (19:21 to 23:35 in earlier runs with more work; the run is CPU-bound, and its time follows the
# machine's speed of the moment: docs/architecture.md), 4 workers 20:30; 2 workers were 21:45 where 3 took 17:22.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$((n + 1 < 4 ? n + 1 : 4)))

.PHONY: help install system-deps wheel-py312 gpu-wheel deploy test test-fast clean lock bench bench-train bench-stage bench-ckpt heat-template \
	image image-lint bench-scale bench-scale-light bench-resume bench-ettr bench-stream bench-keras digits-data

help:
	@echo "make deploy   install, local cloud, digits to its store, up 2 nodes, stage, appliance run across two lease ends, down"
	@echo "make test     install, then the import-layers contract and every test (multi-node ones included)"
	@echo "make test-fast  the contract and the fast tier only (pytest -m \"not e2e\", about 30 s here)"
	@echo "make install  only install (.venv with the pinned stack, Debian packages for the testbed)"
	@echo "make bench    benchmarks: bench-train (appliance bench: throughput, scaling, launch overhead),"
	@echo "              bench-stage (staging vs rclone/s5cmd/aws/swift), bench-ckpt (checkpoint overhead,"
	@echo "              deadline -> commit, steps lost at lease end), bench-scale (up, stage, launch,"
	@echo "              down on 2-16 nodes; bench-scale-light: 16-64 nodes, no TensorFlow in the job),"
	@echo "              bench-resume (a resume's downtime by phase; cold vs warm handover, 15-min boot),"
	@echo "              bench-ettr (a 4-lease managed run's ETTR, cold and warm, 7-day leases modelled),"
	@echo "              bench-stream (stream mode from Ceph RGW vs local disk vs plain tf.data, JPEG decoding on"
	@echo "              2 ranks, the link shaped around the training's demand; ARGS=--synthetic: no decoding),"
	@echo "              bench-keras (Keras 3 vs tf_keras on the same model, samples/s, interleaved rounds);"
	@echo "              results in bench/results"
	@echo "make image    the GPU appliance image with diskimage-builder (docs/image.md)"
	@echo "make gpu-wheel  Horovod's GPU build (NCCL from TensorFlow's wheel) on this machine, and its checks"
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
	@missing=""; for p in $(CEPH_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Ceph (the local object store, RGW):$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "note: not root, cannot install$$missing; the local cloud's store will be OpenStack Swift"; fi; \
	fi

# The stack is installed by images/install-stack.sh, the same steps the image build and the boot-time installer
# (`appliance up --install`) run on GPU nodes; here its CPU variant, so CI exercises them on every run.
$(VENV)/.installed: requirements.lock pyproject.toml images/install-stack.sh
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (fix: install Python 3.11, e.g. apt-get install python3.11-venv)"; exit 1; }
	bash images/install-stack.sh --variant cpu --python $(PYTHON) --venv $(VENV) --lock requirements.lock \
	  --wheels $(WHEEL_CACHE) --appliance . --editable
	touch $@

# Horovod built for Python 3.12 into the wheel cache, by the same script, as a CC-Ubuntu24.04 node would build it
# (the e2e test of such a node takes it from there, as from the object store's wheel cache). Once per machine:
# skipped when the cache has it; the venv it was built in is removed.
STACK312 := build/stack-py3.12
wheel-py312: $(VENV)/.installed
	@if [ -z "$(PYTHON312)" ]; then echo "note: no Python 3.12 here; the CC-image install test boots a CC-Ubuntu22.04 node"; exit 0; fi; \
	args="--variant cpu --python $(PYTHON312) --venv $(STACK312) --lock requirements.lock --appliance ."; \
	tag=$$(bash images/install-stack.sh $$args --print-tag | sed -n 's/^APPLIANCE_STACK_TAG \([^ ]*\).*/\1/p'); \
	if ls $(WHEEL_CACHE)/$$tag/horovod-*.whl >/dev/null 2>&1; then exit 0; fi; \
	wh=$$($(PY) -c 'from appliance.sites.local import local_wheelhouse; print(local_wheelhouse())') && \
	PIP_FIND_LINKS=$$wh bash images/install-stack.sh $$args --wheels $(WHEEL_CACHE) && rm -rf $(STACK312)

# Horovod's GPU build, here, as far as this machine goes (no GPU; docs/image.md "The GPU build, checked here"): the
# lock's GPU TensorFlow and CUDA wheels in a venv of their own, Horovod compiled with CUDA_HOME's nvcc and linked
# against TensorFlow's NCCL wheel by install-stack.sh, then python -m appliance.node.linkage with NVIDIA's cuobjdump
# (a PyPI wheel): NEEDED libnccl.so.2, no NCCL compiled in, the RUNPATH, the compute capabilities inside. CUDA_HOME
# here is a CUDA 13 tree: a compile-and-link check keyed cuda13.0, which no CUDA 12.6 node takes, and which has no
# sm_60/sm_70 (P100, V100): the one failure this target lets pass. ~3 GB of wheels, ~6 min of build on 2 cores.
CUDA_HOME ?= /usr/local/cuda
GPU_VENV := build/stack-gpu
CUOBJDUMP := nvidia-cuda-cuobjdump==13.5.37
gpu-wheel: $(VENV)/.installed
	CUDA_HOME=$(CUDA_HOME) bash images/install-stack.sh \
	  --variant gpu --python $(PYTHON) --venv $(GPU_VENV) --lock requirements.lock --appliance . --wheels build/wheels-gpu
	test -x build/tools/nvidia/cu13/bin/cuobjdump || { $(PIP) download -q --no-deps -d build/tools $(CUOBJDUMP) && \
	  cd build/tools && unzip -q -o nvidia_cuda_cuobjdump-*.whl 'nvidia/*' && chmod +x nvidia/cu13/bin/cuobjdump; }
	PATH=$(CURDIR)/build/tools/nvidia/cu13/bin:$$PATH $(GPU_VENV)/bin/python -m appliance.node.linkage --expect gpu \
	  | tee build/gpu-wheel-check.txt; ! grep '^FAIL' build/gpu-wheel-check.txt | grep -v 'cuda archs'

# the digits dataset in the local cloud's store (starts the local cloud): what the lease-end demo stages
digits-data: install
	$(PY) examples/digits/make_dataset.py build/digits-data
	$(APPLIANCE) data upload build/digits-data swift://digits-data/v1/ --cloud local

deploy: digits-data
	@# up, stage, `appliance run` across two lease ends (a new lease each time); compare with an uninterrupted run
	$(PY) examples/lease_demo.py examples/digits.yaml
	@echo ""
	@echo "next:"
	@echo "  appliance ls                        # runs, steps, checkpoints, node-hours"
	@echo "  appliance up examples/digits.yaml     # a new lease and cluster on the local cloud"
	@echo "  appliance lease list --cloud local    # your leases"
	@echo "  appliance cloud stop                  # stop the local cloud"
	@echo "  OS_CLOUD=CHI@UC appliance up my.yaml  # the same on Chameleon (docs/chameleon.md)"

# The import-layers contract first (.importlinter, docs/architecture.md), then both tiers. .venv-chi: python-chi,
# Chameleon's own client, judges the local cloud (an e2e test).
test: install wheel-py312 .venv-chi/.installed
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The fast tier: no root, no namespaces, no stores.
test-fast: install
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not e2e" $(PYTEST_ARGS)

# No pip in it (uv installs) and no bytecode compiled ahead: only tests/chi_judge.py runs there, and it writes the
# bytecode of what it imports (here --compile-bytecode took 16.9 s of the 18 s this step took; 1.3 s without).
.venv-chi/.installed: requirements-chi.lock $(VENV)/.installed
	test -x .venv-chi/bin/python || $(PYTHON) -m venv --without-pip .venv-chi
	$(VENV)/bin/uv pip install -q --python .venv-chi/bin/python -r requirements-chi.lock
	touch $@

bench/.venv-tools/.installed: bench/requirements-tools.txt
	test -x bench/.venv-tools/bin/python || $(PYTHON) -m venv bench/.venv-tools
	bench/.venv-tools/bin/pip install -q -r bench/requirements-tools.txt
	touch $@

# Staging: our stager vs rclone (swift, s3), s5cmd, aws s3 cp, swift download; bench/results/stage.{json,md,png}
# STORE=rgw: against Ceph RGW (what Chameleon runs): bench/results/stage-rgw.{json,md,png}
# STORE=rgw TLS=1: the RGW over https, as Chameleon serves it: bench/results/stage-rgw-https.{json,md,png}
# ARGS: more of bench/stage_bench.py's options (--datasets, --baseline DIR, --cores 1,2 --tmpfs, --out DIR, ...)
STORE ?= swift
TLS ?=
ARGS ?=
bench-stage: install bench/.venv-tools/.installed
	$(PY) bench/stage_bench.py --tools-venv bench/.venv-tools --store $(STORE) $(if $(TLS),--tls) $(ARGS)

# Stream mode (dataset.mode: stream) vs reading staged shards from local disk, the node's link limited to multiples
# of the training's demand (goal >= 0.9x local at >= 1.2x the demand, input wait <= 5%). By default: JPEGs in the
# local cloud's Ceph RGW, 2 ranks decoding and augmenting them, beside local disk and plain tf.data, at the highest
# demand local disk feeds here (found by the bench); bench/results/stream-decode.{json,md,png}. ARGS: --images N,
# --epochs, --rounds, --step-ms MS (no search), --rates 1.2,0 (multiples of the demand; 0: unshaped), --cache-shards;
# ARGS=--synthetic: random bytes in OpenStack Swift, 1 rank, no decoding: bench/results/stream.{json,md,png}
bench-stream: install
	$(PY) bench/stream_bench.py $(ARGS)

# Keras 3 vs tf_keras: the same model and script, 2 ranks on this machine, interleaved rounds (goal: samples/s
# within 5%). bench/results/keras.{json,md,png}; ARGS: --rounds N, --epochs, --steps
bench-keras: install
	$(PY) bench/keras_bench.py $(ARGS)

# Checkpoints: overhead (goal >= 0.98), deadline -> commit, steps lost at 20 random lease ends (goal 0)
bench-ckpt: install bench/.venv-tools/.installed
	$(PY) bench/ckpt_bench.py --tools-venv bench/.venv-tools

# Training throughput on the 2-node testbed: ResNet-50 (64 px on CPU), a small CNN, an MLP; 1 and 2 nodes;
# then appliance train vs bare horovodrun (goal >= 0.98). bench/results/train/{bench,overhead}.{md,json}, PNGs
BENCH_TRAIN_OUT ?= bench/results/train
bench-train: install
	$(APPLIANCE) testbed up --nodes 2
	$(APPLIANCE) bench examples/digits.yaml --models resnet50,cnn,mlp --batch-sizes 8,16,32 --image-size 64 \
	  --steps 20 --warmup 5 --out $(BENCH_TRAIN_OUT)
	$(APPLIANCE) bench examples/digits.yaml --overhead --models cnn --batch-sizes 32 --steps 100 --repeats 5 \
	  --out $(BENCH_TRAIN_OUT)
	$(APPLIANCE) testbed down

# The control plane at 2, 4, 8, 16 local-cloud nodes: up, stage (full, shard), a tiny Horovod job, down, per phase;
# the launcher's peak memory, threads, files. bench/results/scale.{json,md,png}
bench-scale: install
	$(PY) bench/scale_bench.py

# Where the testbed cannot go with TensorFlow on every node: 16, 32, 64 nodes, a job with no TensorFlow (one result
# line per rank), a 64 MB dataset: the launcher's side at scale. bench/results/scale-light.{json,md,png}
bench-scale-light: install
	$(PY) bench/scale_bench.py --light

# A resume's downtime, phase by phase (issue 16 goal 5): make deploy's lease-end demo, recording its resume.
# bench/results/resume.{json,md,png}
bench-resume: digits-data
	$(PY) examples/lease_demo.py examples/digits.yaml --record bench/results
	$(PY) bench/handover_bench.py bench/results

# a managed run's ETTR over 4 leases, cold and warm, Chameleon's 15-min boot modelled (the local cloud's clock jumps)
bench-ettr: digits-data
	$(PY) bench/ettr_bench.py bench/results

bench: bench-train bench-stage bench-ckpt bench-scale bench-resume

# The Heat template is generated from appliance/provision/{heat_boot,contextualize}.sh (one source of truth)
heat-template: install
	$(PY) -m appliance.provision.heat

lock:
	@echo "regenerating requirements.lock from .venv (check the diff)"
	@# keeps the header comments first and the `# gpu:` block (comments after the packages) last; horovod's pin is
	@# kept as it is (pip freeze names the wheel file it was installed from)
	{ awk '!/^#/{p=1} /^#/ && !p' requirements.lock; \
	  { $(PIP) freeze --exclude-editable | grep -v -E '^(tensorflow==|appliance|horovod)'; \
	    grep '^horovod==' requirements.lock; } | sort -f; \
	  awk '!/^#/{p=1} /^#/ && p' requirements.lock; } > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean:
	-test -x $(APPLIANCE) && $(APPLIANCE) testbed down
	-test -x $(APPLIANCE) && $(APPLIANCE) cloud stop
	rm -rf $(VENV) build *.egg-info
