// The sim_selftest shader compiled for the simulator.
#include "../../../Resources/shaders/sim_selftest.metal"
