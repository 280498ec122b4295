// The kv_append shader compiled for the simulator.
#include "../../../Resources/shaders/kv_append.metal"
