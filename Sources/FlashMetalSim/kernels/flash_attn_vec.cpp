// The flash_attn_vec shader compiled for the simulator.
#include "../../../Resources/shaders/flash_attn_vec.metal"
