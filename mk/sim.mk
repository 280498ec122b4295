# mk/sim.mk — the simulator's conformance suite and the shader dialect lint.
#   make sim-test    build build-sim/sim-conformance, run it in thread order
#                    and again under the scrambled schedule
#   make sim-lint    reject dialect violations in Resources/shaders/*.metal
#   make sim-bench   print the simulator's costs
#   make sim-test-ucontext  the suite on the swapcontext fallback
# The host compiler: clang++ >= 15 (C++20 with the features the shim uses), looked for next to swift (the
# toolchain's own clang), then on PATH, then through xcrun on a Mac. Only a
# user's choice (command line, environment) overrides it, not another
# fragment's default.
ifeq ($(filter command line environment environment override,$(origin SIM_CXX)),)
SIM_CXX := $(shell for c in "$(dir $(realpath $(SWIFT)))clang++" "$$(command -v clang++)" \
	"$$(xcrun -f clang++ 2>/dev/null)"; do \
	v=$$("$$c" -dumpversion 2>/dev/null) && [ "$${v%%.*}" -ge 15 ] 2>/dev/null && { echo "$$c"; break; }; \
	done)
endif
ifeq ($(SIM_CXX),)
SIM_CXX = $(error no clang++ >= 15 found (next to $(SWIFT), on PATH or via xcrun); set SIM_CXX=/path/to/clang++)
endif
SIM_CXXFLAGS := -ISources/CFlashMetal/include -std=c++20 -O2 -pthread -Xclang -ffloat16-excess-precision=none \
	-Werror=double-promotion -Wno-unknown-attributes -Wall -Wno-unused-function
SIM_SRC_DIR := Sources/FlashMetalSim
SIM_RUNTIME := $(SIM_SRC_DIR)/simulator.cpp $(SIM_SRC_DIR)/registry.cpp $(SIM_SRC_DIR)/context_switch.cpp \
	$(SIM_SRC_DIR)/counters.cpp $(SIM_SRC_DIR)/counts_json.cpp
SIM_KERNELS := $(wildcard $(SIM_SRC_DIR)/kernels/*.cpp)
SIM_HEADERS := $(wildcard $(SIM_SRC_DIR)/*.h $(SIM_SRC_DIR)/include/*.h Resources/shaders/*.h \
	Resources/shaders/*.metal tests/sim/*.h) Sources/CFlashMetal/include/flashmetal_kernels.h
SIM_BIN := build-sim/sim-conformance

.PHONY: sim-test sim-lint sim-bench sim-test-ucontext

$(SIM_BIN): $(SIM_RUNTIME) $(SIM_KERNELS) tests/sim/conformance.cpp $(SIM_HEADERS)
	@mkdir -p build-sim
	$(SIM_CXX) $(SIM_CXXFLAGS) -o $@ tests/sim/conformance.cpp $(SIM_RUNTIME) $(SIM_KERNELS)

sim-test: $(SIM_BIN)
	$(SIM_BIN)
	FLASHMETAL_SIM_SCRAMBLE=7 $(SIM_BIN)

sim-bench: $(SIM_BIN)
	$(SIM_BIN) --bench

# The swapcontext fallback (used where there is no hand-written switch).
sim-test-ucontext: $(SIM_RUNTIME) $(SIM_KERNELS) tests/sim/conformance.cpp $(SIM_HEADERS)
	@mkdir -p build-sim
	$(SIM_CXX) $(SIM_CXXFLAGS) -DFMSIM_USE_UCONTEXT -o build-sim/sim-conformance-uc tests/sim/conformance.cpp \
		$(SIM_RUNTIME) $(SIM_KERNELS)
	build-sim/sim-conformance-uc

sim-lint:
	$(PYTHON) tests/sim/lint_dialect.py Resources/shaders
	$(PYTHON) tests/sim/lint_dialect.py --self-test

EXTRA_TESTS += sim-test sim-lint
