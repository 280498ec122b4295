# flashmetal — build the Swift library, install the Python package into .venv,
# run every test. Fragments in mk/*.mk add their own targets and append test
# targets to EXTRA_TESTS.
SHELL := /bin/bash
SWIFT ?= $(shell command -v swift 2>/dev/null || echo /opt/swift/usr/bin/swift)
# Python >= 3.10: the newest python3.1x on PATH, else python3 if it is new
# enough (a stock Mac's python3 is the Command Line Tools' 3.9).
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell for p in python3.13 python3.12 python3.11 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
	&& { echo $$p; break; }; done)
endif
ifeq ($(PYTHON),)
PYTHON = $(error flashmetal needs Python >= 3.10 (python3.13..python3.10 or python3 on PATH); install one or set PYTHON=/path/to/python3)
endif
VENV := .venv
PY := $(VENV)/bin/python
# The OS and the machine, read here and nowhere else: fragments test $(UNAME)
# and $(ARCH). `make mac-plan-dry-run` sets both on the command line to plan
# `make test` as an Apple-silicon Mac would (UNAME=Darwin ARCH=arm64).
UNAME := $(shell uname -s)
ARCH := $(shell uname -m)
LIBNAME := $(if $(filter Darwin,$(UNAME)),libflashmetal.dylib,libflashmetal.so)
LIB := .build/release/$(LIBNAME)
PKG := python/flashmetal
HEADER := Sources/CFlashMetal/include/flashmetal.h
PYTEST_ARGS ?=
EXTRA_TESTS :=
# Fragments below define rules of their own; `make` alone still means `all`.
.DEFAULT_GOAL := all

-include mk/*.mk

.PHONY: all build python venv test swift-test pytest pytest-sim-scrambled pytest-metal-sim-copies demo clean

all: build python

# `swift build`'s arguments as python/setup.py (the wheel's build) states them,
# with the Swift runtime linked into the library on Linux, so `make wheel`
# reuses this build. setup_py_string reads a `NAME = "..."` line of setup.py.
setup_py_string = $(or $(shell sed -n 's/^$(1) = "\(.*\)"$$/\1/p' python/setup.py),$(error python/setup.py has no $(1) = "..." line))
SWIFT_BUILD := $(SWIFT) $(call setup_py_string,SWIFT_BUILD_ARGS) \
	$(if $(filter Linux,$(UNAME)),$(call setup_py_string,SWIFT_LINUX_FLAGS))

build:
	$(SWIFT_BUILD)

# The Python package loads the library and header from its own folder.
# Copied then renamed: overwriting a library in place corrupts it for any
# process that has it loaded.
python: build venv
	cp $(LIB) $(PKG)/.$(LIBNAME).tmp && mv -f $(PKG)/.$(LIBNAME).tmp $(PKG)/$(LIBNAME)
	cp $(HEADER) $(PKG)/.flashmetal.h.tmp && mv -f $(PKG)/.flashmetal.h.tmp $(PKG)/flashmetal.h
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e python

venv: $(VENV)/.installed

$(VENV)/.installed: python/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -r python/requirements.txt
	touch $@

swift-test:
	$(SWIFT) test

pytest: python
	$(PY) -m pytest tests/python -q $(PYTEST_ARGS)

# The sim cases once more under a scrambled schedule: catches kernels that
# lean on SIMD lockstep or on one order of threadgroups. Not metal-sim's:
# the same kernels, already run in a shuffled dispatch order. Half of each
# test's cases (--sample-cases, tests/python/conftest.py): the main run has
# run them all; this stage only changes the schedule.
pytest-sim-scrambled: python
	FLASHMETAL_SIM_SCRAMBLE=11 $(PY) -m pytest tests/python -q -k "sim and not metal" --sample-cases 2 $(PYTEST_ARGS)

# Linux: the metal-sim cases once more with Metal refusing every no-copy
# wrap, so every tensor is copied in (and back when written): the host
# code's copy path, and the runtime's red zones around each copy catch
# kernel writes just outside a tensor. A third of each test's cases
# (--sample-cases): the copy path depends on the tensors' layout, not on
# the head dims and features the main run sweeps.
pytest-metal-sim-copies: python
	FLASHMETAL_METAL_SIM_WRAP=0 $(PY) -m pytest tests/python -q -k "metal and not test_metal_sim and not fuzz" --sample-cases 3 $(PYTEST_ARGS)
ifneq ($(UNAME),Darwin)
EXTRA_TESTS += pytest-metal-sim-copies
endif

# `make test` (every stage, one summary line), `make check` (linters and format
# checks) and `make quick` (the fast pytest loop) live in mk/check.mk.

demo: python
	$(PY) -m flashmetal.demo

clean:
	rm -rf .build $(VENV) $(PKG)/$(LIBNAME) $(PKG)/flashmetal.h
