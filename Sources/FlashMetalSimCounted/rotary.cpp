// The counted copy of rotary.metal (traced loads and stores; see FlashMetalSim/counters.h)
// (written by tools/gen_sim_sources.py; do not edit).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/rotary.metal"
} // namespace fmsim_counted
