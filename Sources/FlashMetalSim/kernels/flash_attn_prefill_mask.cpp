// The flash_attn_prefill_mask shader compiled for the simulator.
#include "../../../Resources/shaders/flash_attn_prefill_mask.metal"
