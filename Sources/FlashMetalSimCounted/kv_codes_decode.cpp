// The counted copy of kv_codes_decode.metal (traced loads and stores; see FlashMetalSim/counters.h)
// (written by tools/gen_sim_sources.py; do not edit).
#include "counted_prelude.h"
#include "../../Resources/shaders/kv_codec.h"
namespace fmsim_counted {
#include "../../Resources/shaders/kv_codes_decode.metal"
} // namespace fmsim_counted
