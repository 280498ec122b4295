# mk/testdeps.mk — the optional test dependencies, torch (CPU build) and
# transformers, installed into .venv before pytest so the drop-in and
# integration tests (tests/python/test_dropin_torch.py, test_integrations.py)
# run. torch: the CPU-only wheel torch==2.13.0+cpu (as mk/bench.mk), else
# torch==2.13.0 without its CUDA dependencies plus the pure-python ones.
# Cost on a fresh venv: ~35 s (wheels from the local find-links / PyPI cache).
TESTDEPS_TORCH ?= 2.13.0
TESTDEPS_STAMP := $(VENV)/.testdeps-installed

.PHONY: test-deps
test-deps: $(TESTDEPS_STAMP)

$(TESTDEPS_STAMP): python/requirements-test.txt | venv
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(TESTDEPS_TORCH)') else 1)" 2>/dev/null; then \
		echo "test-deps: torch $(TESTDEPS_TORCH) already installed"; \
	elif $(PY) -m pip install --quiet "torch==$(TESTDEPS_TORCH)+cpu"; then \
		echo "test-deps: installed torch $(TESTDEPS_TORCH)+cpu"; \
	else \
		$(PY) -m pip install --quiet --no-deps "torch==$(TESTDEPS_TORCH)" && \
		$(PY) -m pip install --quiet filelock typing-extensions sympy networkx jinja2 fsspec; \
	fi
	$(PY) -m pip install --quiet -r python/requirements-test.txt
	touch $@

# pytest needs them: the rule in the Makefile runs after its prerequisites.
pytest: test-deps
