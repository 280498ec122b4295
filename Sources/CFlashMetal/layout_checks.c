// Compile-time proof that the parameter structs have mlx-native's layouts.
#include "flashmetal.h"
#include "flashmetal_kernels.h"

#define FM_AT(T, f, off) _Static_assert(offsetof(T, f) == (off), #T "." #f " offset")

_Static_assert(sizeof(AttnParams) == 160, "AttnParams is 160 bytes");
FM_AT(AttnParams, scale, 24);
FM_AT(AttnParams, softcapping, 28);
FM_AT(AttnParams, qL_off, 56);
FM_AT(AttnParams, Dv, 60);
FM_AT(AttnParams, Q_strides, 64);
FM_AT(AttnParams, K_strides, 88);
FM_AT(AttnParams, V_strides, 112);
FM_AT(AttnParams, O_strides, 136);
_Static_assert(sizeof(AttnMaskParams) == 24, "AttnMaskParams is 24 bytes");
_Static_assert(sizeof(BlkParams) == 16, "BlkParams is 16 bytes");
_Static_assert(sizeof(FlashAttnVecParams) == 48, "FlashAttnVecParams is 48 bytes");
FM_AT(FlashAttnVecParams, nwg, 36);
FM_AT(FlashAttnVecParams, head_dim_v, 40);
_Static_assert(sizeof(FlashAttnVecReduceParams) == 8, "FlashAttnVecReduceParams is 8 bytes");
_Static_assert(sizeof(SdpaParams) == 32, "SdpaParams is 32 bytes");
FM_AT(SdpaParams, do_causal, 28);
_Static_assert(sizeof(SdpaExtParams) == 16, "SdpaExtParams is 16 bytes");
FM_AT(SdpaExtParams, q_offset, 4);
FM_AT(SdpaExtParams, window, 8);
FM_AT(SdpaExtParams, head_dim_v, 12);
_Static_assert(sizeof(FMTensor) == 96, "FMTensor is 96 bytes");
_Static_assert(sizeof(FMRouteCall) == 64, "FMRouteCall is 64 bytes");
FM_AT(FMRouteCall, query_rows, 24);
_Static_assert(sizeof(FMRoute) == 516, "FMRoute is 516 bytes");
_Static_assert(sizeof(FMAttentionCall) == 72, "FMAttentionCall is 72 bytes");
FM_AT(FMAttentionCall, has_scale, 48);
_Static_assert(sizeof(FMAttentionPlan) == 336, "FMAttentionPlan is 336 bytes");
FM_AT(FMAttentionPlan, reason, 80);
_Static_assert(sizeof(AttnSeqParams) == 64, "AttnSeqParams is 64 bytes");
_Static_assert(sizeof(FlashAttnVecSeqParams) == 80, "FlashAttnVecSeqParams is 80 bytes");
FM_AT(AttnSeqParams, attention_chunk, 56);
FM_AT(FlashAttnVecSeqParams, attention_chunk, 56);
FM_AT(FMAttnOptions, attention_chunk, 28);
FM_AT(AttnSeqParams, key_starts_at, 60);
FM_AT(FlashAttnVecSeqParams, key_starts_at, 60);
FM_AT(FlashAttnVecSeqParams, q_rows, 64);
FM_AT(FlashAttnVecSeqParams, window_right, 68);
FM_AT(FlashAttnVecSeqParams, head_major, 72);
FM_AT(FlashAttnVecReduceExtParams, head_rows, 4);
_Static_assert(sizeof(FlashAttnVecReduceExtParams) == 16, "FlashAttnVecReduceExtParams is 16 bytes");
_Static_assert(sizeof(KVAppendParams) == 72, "KVAppendParams is 72 bytes");
_Static_assert(sizeof(RotaryParams) == 24, "RotaryParams is 24 bytes");
_Static_assert(sizeof(FMAttnOptions) == 36, "FMAttnOptions is 36 bytes");
FM_AT(FMAttnOptions, head_major, 32);
_Static_assert(sizeof(FMPrefillOptions) == 32, "FMPrefillOptions is 32 bytes");
FM_AT(FMTensor, tag, 88);
_Static_assert(sizeof(KVCodecParams) == 32, "KVCodecParams is 32 bytes");
FM_AT(KVCodecParams, head_dim, 8);
FM_AT(KVCodecParams, row_bytes, 20);
_Static_assert(sizeof(FMKVCodec) == 16, "FMKVCodec is 16 bytes");
_Static_assert(sizeof(FMKVCodecLayout) == 16, "FMKVCodecLayout is 16 bytes");
_Static_assert(sizeof(KVCodesDecodeParams) == 128, "KVCodesDecodeParams is 128 bytes");
FM_AT(KVCodesDecodeParams, nwg, 116);
FM_AT(KVCodesDecodeParams, batch, 112);
FM_AT(KVCodesDecodeParams, page_size, 104);
_Static_assert(sizeof(KVCodesAppendParams) == 128, "KVCodesAppendParams is 128 bytes");
FM_AT(KVCodesAppendParams, new_strides, 64);
FM_AT(KVCodesAppendParams, n_new, 112);
FM_AT(KVCodesDecodeParams, n_heads, 40);
FM_AT(KVCodesDecodeParams, scale, 80);
_Static_assert(sizeof(FMKVCodesDecodeOptions) == 16, "FMKVCodesDecodeOptions is 16 bytes");
