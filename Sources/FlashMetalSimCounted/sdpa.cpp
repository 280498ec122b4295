// The counted copy of sdpa.metal (traced loads and stores; see
// FlashMetalSim/counters.h).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/sdpa.metal"
} // namespace fmsim_counted
