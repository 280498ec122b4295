# mk/wheel.mk — the installable wheel.
#   make wheel       build dist/flashmetal-*.whl through python/setup.py (SwiftPM,
#                    release, Swift runtime linked statically on Linux)
#   make wheel-test  build it, install it into a fresh venv with the Swift
#                    toolchain off PATH and LD_LIBRARY_PATH clean, check that the
#                    library needs no Swift runtime, run the demo and a numeric check
#                    (tests/python/test_wheel.py). Cost: ~90 s on a fresh clone
#                    (a static release build in .build/wheel), ~15 s when it is warm.
WHEEL_DIR := .build/wheel-dist

.PHONY: wheel wheel-test
wheel: venv
	rm -rf $(WHEEL_DIR)
	FLASHMETAL_SWIFT=$(SWIFT) $(PY) -m pip wheel ./python -w $(WHEEL_DIR) --no-deps --quiet
	@ls $(WHEEL_DIR)/*.whl

wheel-test: wheel
	FLASHMETAL_WHEEL=$$(ls $(CURDIR)/$(WHEEL_DIR)/flashmetal-*.whl) $(PY) -m pytest tests/python/test_wheel.py -q $(PYTEST_ARGS)

EXTRA_TESTS += wheel-test
