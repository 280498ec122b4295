# mk/bench.mk — `make bench`: flashmetal cpu vs torch CPU SDPA vs numpy,
# side by side in one process (bench/bench.py). Writes bench/RESULTS.md and
# bench/ratios.png. BENCH_ARGS passes options (e.g. --quick, --runs 7).
#
# torch: the CPU-only wheel when the index serves it (torch==2.13.0+cpu),
# else torch==2.13.0 with --no-deps (the default Linux wheel would pull GBs
# of CUDA packages) plus the pure-python deps from requirements-bench.txt.
# When neither installs, the bench still runs and says "not installed".
BENCH_ARGS ?=
BENCH_TORCH ?= 2.13.0
BENCH_STAMP := $(VENV)/.bench-installed

# Keep the default goal of the main Makefile: this fragment is included
# before its first rule.
_BENCH_SAVED_GOAL := $(.DEFAULT_GOAL)

.PHONY: bench bench-deps

bench: python bench-deps
	$(PY) bench/bench.py $(BENCH_ARGS)

bench-deps: $(BENCH_STAMP)

$(BENCH_STAMP): python/requirements-bench.txt | venv
	$(PY) -m pip install --quiet -r python/requirements-bench.txt || echo "bench: matplotlib/deps not installed"
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(BENCH_TORCH)') else 1)" 2>/dev/null; then \
		echo "bench: torch $(BENCH_TORCH) already installed"; \
	elif $(PY) -m pip install --quiet "torch==$(BENCH_TORCH)+cpu"; then \
		echo "bench: installed torch $(BENCH_TORCH)+cpu"; \
	elif $(PY) -m pip install --quiet --no-deps "torch==$(BENCH_TORCH)"; then \
		echo "bench: installed torch $(BENCH_TORCH) (--no-deps)"; \
	else \
		echo "bench: torch $(BENCH_TORCH) could not be installed; its columns will say 'not installed'"; \
	fi
	@$(PY) -c "import torch; q = torch.randn(1, 2, 8, 16); print('bench: torch', torch.__version__, 'CPU SDPA ok', tuple(torch.nn.functional.scaled_dot_product_attention(q, q, q).shape))" || true
	touch $@

# Serving: paged vs contiguous decode, varlen vs padded prefill vs
# torch; bench/SERVING_RESULTS.md. Part of `make bench`.
.PHONY: bench-serving
bench-serving: python bench-deps
	$(PY) bench/serving_bench.py $(BENCH_ARGS)
bench: bench-serving

# Decode over quantized KV caches (tq8, tq4, K8/V4) vs the bf16 cache;
# bench/CODES_RESULTS.md. Part of `make bench`.
.PHONY: bench-codes
bench-codes: python bench-deps
	$(PY) bench/codes_bench.py $(BENCH_ARGS)
bench: bench-codes

# Hugging Face generate() with flashmetal's backend vs sdpa, and one masked
# decode step's attention; bench/HF_RESULTS.md. Part of `make bench`.
.PHONY: bench-hf
bench-hf: python bench-deps test-deps
	$(PY) bench/hf_generate_bench.py $(BENCH_ARGS)
bench: bench-hf

# flash-attn's forward test grids (its tests/test_flash_attn.py and
# hopper/test_flash_attn.py): how many cells flashmetal runs, refuses (and
# why) or leaves out of scope, one tiny cpu call per class of cells;
# bench/FLASH_ATTN_GRID.md. A report, not part of `make bench` or `make test`.
.PHONY: flash-attn-grid
flash-attn-grid: python
	$(PY) bench/flash_attn_grid.py

.DEFAULT_GOAL := $(_BENCH_SAVED_GOAL)
