// The prefill shader compiled for the simulator.
#include "../../../Resources/shaders/flash_attn_prefill.metal"
