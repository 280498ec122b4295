# mk/gpu-model.mk — `make gpu-model`: the GPU cost model of the Metal kernels
# (bench/gpu_model.py). Runs every kernel x case on the simulator's counted
# copies at small sizes, scales the counts to the real shapes, and estimates
# times on named Apple GPUs; writes bench/GPU_MODEL.md. Part of `make bench`,
# not of `make test` (minutes of simulation). GPU_MODEL_ARGS passes options
# (e.g. --quick).
GPU_MODEL_ARGS ?= --validate

_GPU_MODEL_SAVED_GOAL := $(.DEFAULT_GOAL)

.PHONY: gpu-model
gpu-model: python
	nice -n 10 $(PY) bench/gpu_model.py $(GPU_MODEL_ARGS)
bench: gpu-model

.DEFAULT_GOAL := $(_GPU_MODEL_SAVED_GOAL)
