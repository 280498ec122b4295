// The flash_attn_prefill_blk shader compiled for the simulator.
#include "../../../Resources/shaders/flash_attn_prefill_blk.metal"
