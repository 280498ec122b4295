// The split decode over quantized caches compiled for the simulator.
#include "../../../Resources/shaders/kv_codes_decode.metal"
