// The rotary shader compiled for the simulator.
#include "../../../Resources/shaders/rotary.metal"
