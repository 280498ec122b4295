// The counted copy of kv_append.metal (traced loads and stores; see
// FlashMetalSim/counters.h).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/kv_append.metal"
} // namespace fmsim_counted
