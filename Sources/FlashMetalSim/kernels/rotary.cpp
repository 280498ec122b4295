// The rotary shader compiled for the simulator (written by tools/gen_sim_sources.py; do not edit).
#include "../../../Resources/shaders/rotary.metal"
