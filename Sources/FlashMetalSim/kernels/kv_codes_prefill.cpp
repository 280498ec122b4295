// The tiled prefill over quantized caches compiled for the simulator.
#include "../../../Resources/shaders/kv_codes_prefill.metal"
