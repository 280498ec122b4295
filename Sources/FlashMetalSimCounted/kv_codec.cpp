// The counted copy of kv_codec.metal (traced loads and stores; see
// FlashMetalSim/counters.h).
#include "counted_prelude.h"
#include "../../Resources/shaders/kv_codec.h"
namespace fmsim_counted {
#include "../../Resources/shaders/kv_codec.metal"
} // namespace fmsim_counted
