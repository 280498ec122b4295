// The counted copy of flash_attn_prefill_blk.metal (traced loads and stores; see FlashMetalSim/counters.h)
// (written by tools/gen_sim_sources.py; do not edit).
#include "counted_prelude.h"
namespace fmsim_counted {
#include "../../Resources/shaders/flash_attn_prefill_blk.metal"
} // namespace fmsim_counted
