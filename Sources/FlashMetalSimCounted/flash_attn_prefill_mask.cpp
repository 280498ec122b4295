// The counted copy of flash_attn_prefill_mask.metal (traced loads and stores; see
// FlashMetalSim/counters.h).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/flash_attn_prefill_mask.metal"
} // namespace fmsim_counted
