# mk/mac.mk — `make mac-check`: every check Linux can make of the macOS build
# (docs/MAC.md). Part of `make test`. Each check is one target in
# MAC_CHECKS; other fragments append theirs (mk/msl.mk adds msl-check).
#   mac-libcxx           the simulator + its conformance suite built against
#                        libc++ 19 (Apple's C++ library) and run
#   mac-swift-typecheck  every Swift target type-checked for macOS at the
#                        deployment target of Package.swift (stdlib interfaces
#                        rebuilt for macOS, cached; stand-ins for Darwin and
#                        Metal), then the planted-error self-test
#   mac-aarch64-sim      the simulator runtime + conformance suite cross-built
#                        for aarch64 and run under qemu (the only run the arm64
#                        context switch gets off a Mac)
# Each check prints its wall time.
#   mac-metal-fake       the Metal backend's host logic run on Linux against a
#                        fake device built on the Metal stand-in (buffers,
#                        copies, barriers, encoder endings, batches, fallback)
#   mac-embedder-lines   a planted #error in sdpa.metal, dialect.h and
#                        flashmetal_kernels.h is located at its own file:line in the
#                        embedded source (the #line directives Metal reports by)
#   mac-pipelines-sim    tests/mac/create_pipelines.py (the macOS job's pass
#                        over every kernel x function-constant combination)
#                        run on the sim backend, so the script is proven here
#   mac-plan-dry-run     (mk/mac-plan.mk) `make test` as an arm64 Mac plans
#                        it holds no Debian, qemu, ELF-only or Linux-path step
# The first four stand in for a Mac with Linux's tools (Debian's libc++ 19,
# the Darwin and Metal stand-ins, qemu): Linux only.
ifeq ($(UNAME),Linux)
MAC_CHECKS += mac-libcxx mac-swift-typecheck mac-aarch64-sim mac-metal-fake
endif
MAC_CHECKS += mac-embedder-lines mac-pipelines-sim

LIBCXX_ROOT := /usr/lib/llvm-19
LIBCXX_FLAGS := -stdlib=libc++ -nostdinc++ -isystem $(LIBCXX_ROOT)/include/c++/v1 \
	-L$(LIBCXX_ROOT)/lib -Wl,-rpath,$(LIBCXX_ROOT)/lib
AARCH64_SYSROOT := /usr/aarch64-linux-gnu
AARCH64_FLAGS := --target=aarch64-linux-gnu -fuse-ld=lld
# sim.mk is included after this fragment: expanded late (recipes, $$ prerequisites).
SIM_SOURCES = tests/sim/conformance.cpp $(SIM_RUNTIME) $(SIM_KERNELS)
MAC_TIME = /usr/bin/env TIMEFORMAT="$@: %R s" bash -c 'time "$$@"' --

.PHONY: mac-check mac-libcxx mac-swift-typecheck mac-aarch64-sim mac-metal-fake mac-embedder-lines mac-pipelines-sim

.SECONDEXPANSION:
mac-check: $$(MAC_CHECKS)
	@echo "mac-check: passed ($(MAC_CHECKS))"

build-sim/sim-conformance-libcxx: $$(SIM_SOURCES) $$(SIM_HEADERS) | libcxx-deps
	@mkdir -p build-sim
	$(SIM_CXX) $(SIM_CXXFLAGS) $(LIBCXX_FLAGS) -o $@ $(SIM_SOURCES)

mac-libcxx: build-sim/sim-conformance-libcxx
	@ldd $< | grep -q "libc++.so" && ! ldd $< | grep -q "libstdc++" || { echo "$<: not linked against libc++ alone"; exit 1; }
	@$(MAC_TIME) $<
	@FLASHMETAL_SIM_SCRAMBLE=7 $(MAC_TIME) $<

mac-swift-typecheck: build
	@$(MAC_TIME) $(PYTHON) tests/mac/swift_typecheck.py --self-test

build-sim/sim-conformance-aarch64: $$(SIM_SOURCES) $$(SIM_HEADERS) | aarch64-deps
	@mkdir -p build-sim
	$(SIM_CXX) $(AARCH64_FLAGS) $(SIM_CXXFLAGS) -o $@ $(SIM_SOURCES)

# The binary must be arm64 and carry the hand-written arm64 switch (not the
# swapcontext fallback): that switch is what Apple silicon runs.
mac-aarch64-sim: build-sim/sim-conformance-aarch64
	@[ "$$(od -An -tx2 -j18 -N2 $<)" = " 00b7" ] || { echo "$<: not an aarch64 ELF (e_machine 0xb7)"; exit 1; }
	@grep -aq "arm64 asm" $< || { echo "$<: built without the arm64 context switch"; exit 1; }
	@$(MAC_TIME) qemu-aarch64 -L $(AARCH64_SYSROOT) $<
	@FLASHMETAL_SIM_SCRAMBLE=7 $(MAC_TIME) qemu-aarch64 -L $(AARCH64_SYSROOT) $<

mac-metal-fake: build
	@$(MAC_TIME) tests/mac/metal_fake.sh

mac-embedder-lines:
	@$(MAC_TIME) $(PYTHON) tests/mac/embedder_lines_test.py $(SIM_CXX)

mac-pipelines-sim: python
	@$(MAC_TIME) $(PY) tests/mac/create_pipelines.py --backend sim

# On a Mac the real toolchain, SDK and Metal compiler take over (CI's macOS job).
ifneq ($(UNAME),Darwin)
EXTRA_TESTS += mac-check
endif
