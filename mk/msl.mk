# mk/msl.mk — the shaders held to what Metal accepts, without a Mac.
#   make sim-strict   the simulator's shim rejects what MSL rejects (planted
#                     snippets must fail to compile; a control must compile)
#   make msl-check    every shader compiled as MSL would check it (C++14,
#                     address spaces made real, a stand-in <metal_stdlib>),
#                     after a self-test that planted errors are rejected
SIM_CXX ?= /opt/swift/usr/bin/clang++

.PHONY: sim-strict msl-check

sim-strict:
	python3 tests/msl/shim_strict.py $(SIM_CXX)

EXTRA_TESTS += sim-strict

# Part of mac-check (mk/mac.mk runs every target in MAC_CHECKS), not of the
# plain test list: run it alone with `make msl-check`.
msl-check:
	python3 tests/msl/msl_check.py $(SIM_CXX)

MAC_CHECKS += msl-check
