// The sdpa shader compiled for the simulator.
#include "../../../Resources/shaders/sdpa.metal"
