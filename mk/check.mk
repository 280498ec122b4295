# mk/check.mk — `make check`: ruff, mypy (strict on python/flashmetal), and the
# format checks of the Swift (swift format, from the toolchain) and the C, C++
# and MSL sources (clang-format, from PyPI into .venv); `make quick`: build,
# install, and pytest without the tests marked slow. And the stages of `make
# test` with one summary line at the end (mk/stage_counts.py).
#   lint-python   ruff (ruff.toml) over python, tests, bench, tools; mypy (python/pyproject.toml)
#   format-swift  swift format lint (.swift-format): every enabled rule, spacing,
#                 blank lines and line length; not the continuation-line layout
#                 (Indentation, AddLines, RemoveLine, TrailingComma), which
#                 swift-format cannot express as the sources align it
#   format-c      clang-format (.clang-format) spacing within lines, trailing
#                 whitespace, tabs (tests/lint/clang_format_check.py)
LINT_STAMP := $(VENV)/.lint-installed
CHECK_STAGES := lint-python format-swift format-c
SWIFT_FORMAT_PATHS := Sources tests/swift Package.swift Plugins
C_FORMAT_FILES = $(shell find Sources Resources tests \( -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name '*.metal' \) \
	-not -path 'tests/mac/stand-ins/*' | sort)
TEST_SUMMARY := .build/test-summary.txt

.PHONY: check quick lint-deps test-plan $(CHECK_STAGES)

check: $(CHECK_STAGES)

quick: python
	$(PY) -m pytest tests/python -q -x -m "not slow" $(PYTEST_ARGS)

lint-deps: $(LINT_STAMP)

$(LINT_STAMP): python/requirements-lint.txt | venv
	$(PY) -m pip install --quiet -r python/requirements-lint.txt
	touch $@

lint-python: lint-deps
	$(VENV)/bin/ruff check python tests bench tools
	cd python && ../$(VENV)/bin/mypy flashmetal

format-swift:
	@out=$$($(SWIFT) format lint --recursive $(SWIFT_FORMAT_PATHS) 2>&1 \
		| grep -v -E '\[(Indentation|AddLines|RemoveLine|TrailingComma)\]'); \
	if [ -n "$$out" ]; then echo "$$out"; exit 1; fi; echo "format-swift: passed"

format-c: lint-deps
	$(PY) tests/lint/clang_format_check.py $(VENV)/bin/clang-format $(C_FORMAT_FILES)

# Every stage runs (a failure does not hide the later ones), each counted from
# its log; the last line is "N passed, N failed, N skipped" and the exit status
# is non-zero when any stage failed. A failed build stops the run. Before it,
# tests/summary.py names where it ran and the backends the numeric tests used.
# mk/run_test.sh runs the build and test-tools first, then the pytest stages
# (TEST_MAIN_LANE) beside the other stages, two lanes on two cores.
TEST_STAGES = all test-tools swift-test pytest pytest-sim-scrambled $(EXTRA_TESTS) $(CHECK_STAGES)
TEST_FIRST := all test-tools
TEST_MAIN_LANE := pytest pytest-sim-scrambled pytest-metal-sim-copies

# Everything the stages install into .venv, before the lanes split: two pip
# runs must never write the venv while the other lane imports from it.
TEST_TOOLS := test-deps lint-deps $(if $(filter Linux,$(UNAME)),wheel-deps)
.PHONY: test-tools
test-tools: $(TEST_TOOLS)

# `make -n test-plan` prints every command of every stage of `make test`
# without running any (mk/mac-plan.mk's dry run reads it): `make -n test`
# would run test's recipe, since it calls $(MAKE).
.SECONDEXPANSION:
test-plan: $$(TEST_STAGES)
	$(PY) tests/summary.py --os $(UNAME) --arch $(ARCH) $(TEST_STAGES)
	$(PYTHON) mk/stage_counts.py --total $(TEST_SUMMARY)

test:
	@MAKE="$(MAKE)" PYTHON="$(PYTHON)" TEST_SUMMARY="$(TEST_SUMMARY)" bash mk/run_test.sh \
		"$(TEST_FIRST)" "$(filter $(TEST_MAIN_LANE),$(TEST_STAGES))" \
		"$(filter-out $(TEST_FIRST) $(TEST_MAIN_LANE),$(TEST_STAGES))" \
		$(PY) tests/summary.py --os $(UNAME) --arch $(ARCH) $(TEST_STAGES)
