// The quantized-KV codec shader compiled for the simulator.
#include "../../../Resources/shaders/kv_codec.metal"
