// The counted copy of sim_selftest.metal (traced loads and stores; see FlashMetalSim/counters.h)
// (written by tools/gen_sim_sources.py; do not edit).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/sim_selftest.metal"
} // namespace fmsim_counted
