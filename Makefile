# ductile: `make demo` runs the main job, `make test` runs every test.
# Both install what is missing (Debian packages; you must be root or have sudo).

BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=

# Debian packages the build, the tests and the demo need.
DEBS := build-essential cmake pkg-config python3 python3-venv clang libclang-rt-14-dev \
        libcurl4-gnutls-dev libssh2-1-dev libcjson-dev zlib1g-dev libmicrohttpd-dev libopenblas-dev \
        etcd-server etcd-client dataset-fashion-mnist iproute2 procps

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build asan test test-long demo bench fuzz clean

all: build

deps:
	@missing=$$(for p in $(DEBS); do \
	    dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; \
	  done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	fi

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# The sanitizer build is also the GPU test build: its GPU sources link the
# host test runtime (tests/gpurt), so every GPU test, multi-rank NCCL and the
# GPU e2e included, runs on a machine without a GPU. The optimised build
# links the real CUDA libraries when nvcc is there.
asan: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DDUCTILE_SANITIZE=ON -DDUCTILE_FUZZ=ON \
	  -DDUCTILE_GPU_RUNTIME=host $(CMAKE_ARGS) >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# Every test, under ASan/UBSan (the GPU ones on the host test runtime); the
# optimised build is compiled too so its warnings count, CUDA's included. A test runs once: one that passes only on a second try is
# a bug. Each fault path of the e2e core, and the GPU path's local NCCL
# failure, run again with every core kept busy
# (tests/harness/contend.py); those run alone (RUN_SERIAL), the rest $(JOBS)
# at a time, so no test may depend on a quiet machine. The ten slowest are
# listed at the end, then ctest's count again, as the last line.
test: build asan
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure --timeout 1200 -j $(JOBS) -LE long --output-log ctest.log; \
	  rc=$$?; python3 $(CURDIR)/tests/harness/slowest.py Testing/Temporary/LastTest.log; \
	  grep -E 'tests passed, [0-9]+ tests? failed out of' ctest.log | tail -1; exit $$rc

# Soak and chaos runs, the whole e2e matrix, and the agent tests and the GPU
# e2e core again with every core kept busy (agent.*.contended,
# e2e.gpu.contended; one at a time): longer than `make test`. The GPU e2e
# tests exist in the sanitizer build only (the host test runtime).
test-long: build asan
	cd $(BUILD) && ctest --output-on-failure --timeout 3600 -L long
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure --timeout 3600 -L long -R '^e2e\.gpu\.'

# PyTorch under the agent: an unmodified DDP script, and scripts rebuilt in
# place by ductile.torch (python/, installed here with pip as a user would;
# the tests import it from the tree). torch (several GiB from PyPI) goes
# into $(ASAN_BUILD)/torch-venv; `make test` skips these tests without it.
.PHONY: test-torch
test-torch: asan
	[ -x $(ASAN_BUILD)/torch-venv/bin/python ] || python3 -m venv $(ASAN_BUILD)/torch-venv
	$(ASAN_BUILD)/torch-venv/bin/python -c 'import torch, numpy' 2>/dev/null || \
	  $(ASAN_BUILD)/torch-venv/bin/pip install -q torch numpy
	$(ASAN_BUILD)/torch-venv/bin/pip install -q --no-deps ./python
	$(ASAN_BUILD)/torch-venv/bin/python -I -c 'import ductile.torch'
	cd $(ASAN_BUILD) && ctest --output-on-failure --timeout 900 -L torch

demo: build
	examples/demo.sh $(BUILD)

bench: build
	bench/run.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
