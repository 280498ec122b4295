// The counted copy of kv_codec.metal (traced loads and stores; see FlashMetalSim/counters.h)
// (written by tools/gen_sim_sources.py; do not edit).
#include "counted_prelude.h"
#include "../../Resources/shaders/kv_codec.h"
namespace fmsim_counted {
#include "../../Resources/shaders/kv_codec.metal"
} // namespace fmsim_counted
