# mk/kernels.mk — the generated kernel sources: the shaders' INSTANTIATE_KERNEL
# lines, from the capability tables (Sources/FlashMetalCore/Capabilities.swift)
# through the built library by tools/gen_instantiations.py, and the simulator's
# source of each shader (tools/gen_sim_sources.py); then built into the library.
# tests/python/test_kernel_instantiations.py fails when a checked-in file
# differs from its generator's output.
.PHONY: kernel-instantiations

kernel-instantiations: python
	$(PY) tools/gen_instantiations.py --lib $(PKG)/$(LIBNAME)
	$(PY) tools/gen_sim_sources.py
	$(MAKE) python
