// The counted copy of kv_append.metal (traced loads and stores; see FlashMetalSim/counters.h)
// (written by tools/gen_sim_sources.py; do not edit).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/kv_append.metal"
} // namespace fmsim_counted
