// The counted copy of rotary.metal (traced loads and stores; see
// FlashMetalSim/counters.h).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/rotary.metal"
} // namespace fmsim_counted
