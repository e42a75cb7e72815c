# arfuse build.
#
#   make                 generate the default matrix into out/, compile it, link the torch extension
#                        into arfuse/_lib/ and build the wheel into dist/
#   make install         the wheel into PYTHON's environment, or INTO=/path/to/python's (--no-deps:
#                        that environment keeps its torch, which must be 2.11 or later)
#   make gen             build the generator, build/bin/gen (what generate runs)
#   make test            Go checks and tests, a full nvcc build of variants/ci.yaml, Python tests in
#                        two lanes (vLLM 0.26 + torch 2.11, vLLM 0.34 + torch 2.14), vLLM contract check
#                        (GPU tests run when a GPU is present and are reported skipped otherwise)
#   make MATRIX=ci|default|full      choose the matrix for `make`
#
# Data flow: variants/*.yaml -> build/bin/gen -> out/ (kernels/*.cu, dispatch, registration,
# manifest, sources.mk) -> nvcc / g++ -> libarfuse_ops.so -> wheel. gen/tables.go -> build/bin/gen
# -> csrc/arfuse/vocab.h and arfuse/_vocab_tables.py (checked in, so that SKIP_GEN=1 builds
# without Go; every generator run rewrites them when the tables changed, make check-generated
# fails while they are stale).
# On the GPU machine (no Go, no network): make lib SKIP_GEN=1 PYTHON=python3 NVCC=nvcc

MATRIX    ?= default
# The generator's output folder. Not named OUT: many environments (CI systems, the GPU machine) set that.
GENDIR    ?= out
BUILD     ?= build/$(MATRIX)
LIBDIR    ?= arfuse/_lib
SKIP_GEN  ?= 0
GO        ?= go
VENV      ?= .venv
PYTHON    ?= $(VENV)/bin/python
JOBS      ?= $(shell nproc 2>/dev/null || echo 2)
ARCH_FLAGS ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
# Extra nvcc flags, e.g. a kernel experiment's -D knob (lab/scripts/kernel_ab.sh prepare NAME=.+DEFINE)
NVCC_EXTRA ?=

LIB       := $(LIBDIR)/libarfuse_ops.so
HAND_CU   := csrc/kernels.cu
HAND_CXX  := $(sort $(wildcard csrc/host/*.cpp)) csrc/dispatch.cpp
HEADERS   := $(wildcard csrc/arfuse/*.h csrc/arfuse/*.cuh csrc/host/*.h)
# The op library is built on the PyTorch stable ABI against torch 2.11's headers: it imports only
# torch's C shims (aoti_torch_* / torch_*), so the same file loads under torch 2.11 and later
# releases (tests/test_stable_abi.py reads its undefined symbols). TORCH_TARGET_VERSION 2.11.
TORCH_TARGET := 0x020b000000000000

.PHONY: all env vllm-env toolchain gen generate lib wheel install test test-go test-python test-gpu check-generated clean help ci-wheel test-installed
.DEFAULT_GOAL := all

all: wheel

help:
	@sed -n '3,18p' Makefile

# ---- environment -------------------------------------------------------------------------------
env:
ifeq ($(PYTHON),$(VENV)/bin/python)
	@scripts/bootstrap.sh $(VENV)
endif

# vLLM 0.26.0 (pinned by requirements-vllm.txt) for tests/vllm; those tests skip where it is absent
# (with the reason, e.g. too little disk space for the install).
# Not part of test-gpu: the GPU machine has no network.
vllm-env: env
	@scripts/install-vllm.sh $(PYTHON)

# nvcc: NVCC if given, else nvcc on PATH when its CUDA major matches torch's, else the project-local
# toolchain from the Python package registry (scripts/install-cuda.sh).
toolchain: env
	@nvcc_path="$(NVCC)"; \
	if [ -z "$$nvcc_path" ]; then \
	  want=$$($(PYTHON) -c 'import torch; print((torch.version.cuda or "").split(".")[0])'); \
	  if command -v nvcc >/dev/null 2>&1 && nvcc --version | grep -q "release $$want\."; then nvcc_path=$$(command -v nvcc); \
	  else nvcc_path=$$(scripts/install-cuda.sh $(PYTHON) .cuda | tail -n 1); fi; \
	fi; \
	nvcc_path=$$(command -v "$$nvcc_path" || echo "$$nvcc_path"); nvcc_path=$$(readlink -f "$$nvcc_path"); \
	mkdir -p build; echo "$$nvcc_path" > build/nvcc.path.$$$$ && mv -f build/nvcc.path.$$$$ build/nvcc.path; echo "nvcc: $$nvcc_path"

# The generator as a binary: its exit status is the documented one (0, 1 for --check
# differences, 2 for bad input), which `go run` would turn into 1 and an "exit status N" line.
GEN_BIN := build/bin/gen
gen:
	@$(GO) build -o $(GEN_BIN) ./gen

generate:
ifeq ($(SKIP_GEN),0)
	@$(MAKE) --no-print-directory gen
	$(GEN_BIN) --matrix $(MATRIX) --out $(GENDIR)
endif

# The compile is a parallel make (_lib below); each object prints "[n/N] file (seconds)" when it
# is done, n counting the objects finished in this run, N the objects of the library (an
# incremental build stops short of N: the rest were up to date).
lib: toolchain generate
	@mkdir -p $(BUILD) && rm -f $(BUILD)/.done
	@$(MAKE) --no-print-directory -j$(JOBS) _lib MATRIX=$(MATRIX) GENDIR=$(GENDIR) BUILD=$(BUILD) LIBDIR=$(LIBDIR) PYTHON=$(PYTHON)

# The wheel: scripts/build_wheel.sh stages the package (discovered, not listed) with this library,
# its manifest and models.yaml, and builds it; make test builds its CI-matrix wheel the same way.
wheel: lib
	@cp variants/models.yaml $(LIBDIR)/models.yaml
	@cp $(GENDIR)/manifest.json $(LIBDIR)/manifest.json
	@scripts/build_wheel.sh $(PYTHON) $(LIB) $(GENDIR)/manifest.json dist >/dev/null
	@ls -l dist/*.whl

# The wheel into an environment that has torch 2.11 or later (CUDA 13 build): --no-deps, so that
# the environment's torch (a vLLM environment's, say) stays. Then `import arfuse` works anywhere.
INTO ?= $(PYTHON)
install: wheel
	@$(INTO) -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 11) else f"make install: {sys.executable} has torch {torch.__version__}; arfuse needs torch 2.11 or later")'
	$(INTO) -m pip install -q --no-deps --force-reinstall dist/arfuse-*.whl
	@cd / && $(abspath $(INTO)) -c 'import arfuse; print("installed arfuse", arfuse.__version__, "in", arfuse.__file__.rsplit("/", 1)[0], "(library loaded)" if arfuse.is_built() else "(LIBRARY NOT LOADED)")'

# ---- the compile and link step (a second make, so that it reads the freshly generated list) ----
ifneq ($(filter _lib,$(MAKECMDGOALS)),)
ARFUSE_OUT := $(GENDIR)
include $(GENDIR)/sources.mk
NVCC_BIN   := $(shell cat build/nvcc.path)
CUDA_HOME  := $(abspath $(dir $(NVCC_BIN))/..)
TORCH_DIR  := $(shell $(PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))')
TORCH_ABI  := $(shell $(PYTHON) -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
CUDART_DIR := $(shell $(PYTHON) -c 'import glob, os, torch; c = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib", "libcudart.so*")); print(os.path.dirname(os.path.abspath(c[0])) if c else "")')
NVCC_FLAGS := -std=c++17 -O3 $(ARCH_FLAGS) -Xcompiler -fPIC -Icsrc -I$(GENDIR) -DNDEBUG -lineinfo $(NVCC_EXTRA)
CXX_FLAGS  := -std=c++17 -O2 -fPIC -Icsrc -I$(GENDIR) -I$(CUDA_HOME)/include -I$(CUDA_HOME)/targets/x86_64-linux/include \
              -isystem $(TORCH_DIR)/include -DTORCH_TARGET_VERSION=$(TORCH_TARGET) -DUSE_CUDA \
              -D_GLIBCXX_USE_CXX11_ABI=$(TORCH_ABI) -fvisibility=hidden -DNDEBUG -Wall -Wno-unused-function
# libtorch_cpu / libtorch_cuda export the C shims; the loader must find them (no RPATH: torch has
# loaded them when torch.ops.load_library runs). cudart: the one torch loaded (same soname).
LD_FLAGS   := -shared -Wl,--no-as-needed -L$(TORCH_DIR)/lib -ltorch -ltorch_cpu -ltorch_cuda -Wl,--as-needed \
              $(if $(CUDART_DIR),-L$(CUDART_DIR),-L$(CUDA_HOME)/lib -L$(CUDA_HOME)/lib64) -l:libcudart.so.13

CU_OBJS  := $(patsubst $(GENDIR)/%.cu,$(BUILD)/gen/%.o,$(ARFUSE_CU_SOURCES)) $(BUILD)/csrc/kernels.o
CXX_OBJS := $(patsubst $(GENDIR)/%.cpp,$(BUILD)/gen/%.o,$(ARFUSE_CXX_SOURCES)) \
            $(patsubst csrc/%.cpp,$(BUILD)/csrc/%.o,$(HAND_CXX))
N_OBJS   := $(words $(CU_OBJS) $(CXX_OBJS))
$(info $(LIB): $(N_OBJS) objects; those out of date compiled $(JOBS) at a time, each printed as it finishes)

# compile(tool, command): runs the command, then prints "[n/N] source (seconds)". n is the line
# of this object in $(BUILD)/.done, to which each finished object appends itself (one short
# append each, so parallel jobs cannot interleave): exact under -j without a lock.
define compile
@mkdir -p $(dir $@)
@t0=$$(date +%s); $(2) && echo "$@" >> $(BUILD)/.done && \
  echo "[$$(grep -n -x -F "$@" $(BUILD)/.done | head -n 1 | cut -d: -f1)/$(N_OBJS)] $(1) $< ($$(( $$(date +%s) - t0 )) s)"
endef

_lib: $(LIB)

$(LIB): $(CU_OBJS) $(CXX_OBJS)
	@mkdir -p $(dir $@)
	@echo "g++ -o $@ ($(words $^) objects) $(LD_FLAGS)"
	@g++ -o $@ $^ $(LD_FLAGS)
	@echo "built $@ ($$(du -h $@ | cut -f1), $(words $(ARFUSE_CU_SOURCES)) generated CUDA sources; $$(cat $(BUILD)/.done 2>/dev/null | wc -l) of $(N_OBJS) objects compiled in this run)"

$(BUILD)/gen/%.o: $(GENDIR)/%.cu $(HEADERS)
	$(call compile,nvcc,$(NVCC_BIN) $(NVCC_FLAGS) -c $< -o $@)

$(BUILD)/csrc/%.o: csrc/%.cu $(HEADERS)
	$(call compile,nvcc,$(NVCC_BIN) $(NVCC_FLAGS) -c $< -o $@)

$(BUILD)/gen/%.o: $(GENDIR)/%.cpp $(HEADERS)
	$(call compile,g++,g++ $(CXX_FLAGS) -c $< -o $@)

$(BUILD)/csrc/%.o: csrc/%.cpp $(HEADERS) $(GENDIR)/sources.mk
	$(call compile,g++,g++ $(CXX_FLAGS) -c $< -o $@)
endif

# ---- tests ---------------------------------------------------------------------------------------
CI_OUT   := build/ci/out
CI_LIB   := build/ci/lib
CI_DIST  := build/ci/dist

# make test: lane A (Go, the CI-matrix build and its wheel, vLLM 0.26.0 + torch 2.11 in .venv, the
# whole Python suite), the static contract check of every vLLM release between the lanes, then
# lane B (vLLM 0.34.0 + torch 2.14 in their own environment, the whole Python suite again against
# the SAME wheel that lane A built). Each lane tests what users install: the wheel goes into the
# lane's environment (pip install --no-deps, as make install INTO= does) and pytest runs from a
# folder outside the checkout with ARFUSE_TEST_INSTALLED=1, so `import arfuse` resolves to
# site-packages and the library to the wheel's (tests/conftest.py checks both). docs/vllm.md,
# "Test lanes".
# The kernel build before the vLLM install: on a machine short of disk the vLLM tests are the ones
# that give way (scripts/install-vllm.sh), never the build.
test: test-go check-generated
	@$(MAKE) --no-print-directory ci-wheel
	@echo "== lane A: vLLM 0.26.0, torch 2.11 ($(PYTHON))"
	@$(MAKE) --no-print-directory vllm-env PYTHON=$(PYTHON)
	@$(MAKE) --no-print-directory test-python
	@echo "== the vLLM releases between the lanes, checked statically"
	@$(MAKE) --no-print-directory test-vllm-contract
	@$(MAKE) --no-print-directory test-lane-b

test-go:
ifeq ($(SKIP_GEN),0)
	$(GO) vet ./...
	@test -z "$$(gofmt -l gen templates)" || { echo "gofmt would change:"; gofmt -l gen templates; exit 1; }
	$(GO) test ./...
endif

# The committed templates and matrices must generate exactly what a fresh run generates, and the
# checked-in vocabulary (csrc/arfuse/vocab.h, arfuse/_vocab_tables.py) must be what gen/tables.go
# says: the first run leaves it alone (--root ""), the --check run compares it (--root ., the
# default) along with build/check.
check-generated:
ifeq ($(SKIP_GEN),0)
	@$(MAKE) --no-print-directory gen
	@rm -rf build/check && $(GEN_BIN) --matrix ci --out build/check --root "" >/dev/null && $(GEN_BIN) --matrix ci --out build/check --check
endif

# The CI-matrix library and its wheel (build/ci/dist), made as `make` makes the release wheel.
ci-wheel:
	@$(MAKE) --no-print-directory lib MATRIX=ci GENDIR=$(CI_OUT) BUILD=build/ci/obj LIBDIR=$(CI_LIB) PYTHON=$(PYTHON) SKIP_GEN=$(SKIP_GEN)
	@scripts/build_wheel.sh $(PYTHON) $(CI_LIB)/libarfuse_ops.so $(CI_OUT)/manifest.json $(CI_DIST) >/dev/null
	@echo "wheel: $$(ls $(CI_DIST)/arfuse-*.whl) ($$(du -k $(CI_DIST)/arfuse-*.whl | cut -f1) kB)"

# test-installed TEST_PYTHON=...: the CI wheel into TEST_PYTHON's environment, then the whole
# suite from an empty folder outside the checkout (pytest's rootdir and configuration are still
# the checkout's: tests/ and pyproject.toml). ARFUSE_WHEEL: the wheel tests/test_wheel.py reads.
TEST_PYTHON ?= $(PYTHON)
TEST_PATHS  ?= $(CURDIR)/tests
test-installed:
	@$(TEST_PYTHON) -m pip install -q --no-deps --force-reinstall --no-warn-conflicts $(CI_DIST)/arfuse-*.whl
	@py=$$($(TEST_PYTHON) -c 'import sys; print(sys.executable)'); run=$$(mktemp -d); \
	echo "== pytest tests with $$py, from $$run, against the installed $$(ls $(CI_DIST)/arfuse-*.whl)"; \
	cd $$run && env -u ARFUSE_LIBRARY -u ARFUSE_MANIFEST ARFUSE_TEST_INSTALLED=1 \
	  ARFUSE_WHEEL=$$(ls $(abspath $(CI_DIST))/arfuse-*.whl) \
	  $$py -m pytest -q -ra -p no:cacheprovider --rootdir $(CURDIR) $(TEST_PATHS) $(PYTEST_ARGS); \
	rc=$$?; cd / && rm -rf $$run; exit $$rc

test-python: env
	@$(MAKE) --no-print-directory test-installed TEST_PYTHON=$(PYTHON)

# The GPU suite alone (on the GPU machine): make test-gpu PYTHON=python3 SKIP_GEN=1 NVCC=nvcc
test-gpu:
	@$(MAKE) --no-print-directory lib MATRIX=ci GENDIR=$(CI_OUT) BUILD=build/ci/obj LIBDIR=$(CI_LIB) PYTHON=$(PYTHON) SKIP_GEN=$(SKIP_GEN)
	ARFUSE_LIBRARY=$(abspath $(CI_LIB))/libarfuse_ops.so ARFUSE_MANIFEST=$(abspath $(CI_OUT))/manifest.json \
	  $(PYTHON) -m pytest -q -ra tests -m gpu

# Lane B (docs/vllm.md): vLLM 0.34.0 and torch 2.14 in their own environment (about 7 GB kept, 8 GB at
# the peak of its install), the whole Python suite against the stable-ABI library lane A built.
# Where less than LANE_B_FREE_MB is free, lane A's environment (.venv, which the next `make`
# rebuilds) is removed first; where even then the install runs out of space, lane B is skipped
# with the reason, as lane A's vLLM tests are. The static check reads every release's wheel from
# PyPI, one at a time (about 300 MB each, deleted after); it needs neither torch nor vLLM.
VLLM_B_ENV    ?= build/vllm-b
LANE_B_FREE_MB ?= 12000
.PHONY: test-lane-b test-vllm-b test-vllm-contract

test-lane-b:
	@free=$$(df -Pm . | awk 'NR == 2 {print $$4}'); \
	if [ ! -x $(VLLM_B_ENV)/bin/python ] && [ "$$free" -lt $(LANE_B_FREE_MB) ] && [ "$(PYTHON)" = "$(VENV)/bin/python" ]; then \
	  echo "== lane B: $$free MB free, less than $(LANE_B_FREE_MB): removing lane A's $(VENV) first"; rm -rf $(VENV); fi
	@echo "== lane B: vLLM 0.34.0, torch 2.14 ($(VLLM_B_ENV))"
	@scripts/install-vllm.sh $(VLLM_B_ENV)/bin/python requirements-vllm-0.34.txt
	@if [ -f $(VLLM_B_ENV)/.arfuse-vllm-skipped ]; then echo "== lane B skipped: $$(cat $(VLLM_B_ENV)/.arfuse-vllm-skipped)"; \
	else $(MAKE) --no-print-directory test-installed TEST_PYTHON=$(VLLM_B_ENV)/bin/python; fi

# tests/vllm alone in lane B.
test-vllm-b:
	@scripts/install-vllm.sh $(VLLM_B_ENV)/bin/python requirements-vllm-0.34.txt
	@$(MAKE) --no-print-directory test-installed TEST_PYTHON=$(VLLM_B_ENV)/bin/python TEST_PATHS=$(CURDIR)/tests/vllm

test-vllm-contract:
	python3 scripts/vllm_contract.py

clean:
	rm -rf out build dist arfuse/_lib
