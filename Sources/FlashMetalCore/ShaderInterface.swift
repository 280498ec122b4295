import CFlashMetal

// The integers the shaders and the host agree on, read from flashmetal_kernels.h
// (FMFunctionConstant and the FM*Binding enums): Swift names for them, no
// second copy of the values.

/// Function-constant indices of the kernels.
public enum FunctionConstantIndex {
    /// Prefill: qL is a multiple of BQ.
    public static let alignQ = Int(FM_FC_ALIGN_Q.rawValue)
    /// Prefill: kL is a multiple of BK.
    public static let alignK = Int(FM_FC_ALIGN_K.rawValue)
    /// Prefill: a mask is bound.
    public static let hasMask = Int(FM_FC_HAS_MASK.rawValue)
    /// Prefill: causal.
    public static let doCausal = Int(FM_FC_DO_CAUSAL.rawValue)
    /// Prefill: a blk is bound.
    public static let hasBlk = Int(FM_FC_HAS_BLK.rawValue)
    /// Prefill serving extension: sinks bound.
    public static let hasSinks = Int(FM_FC_HAS_SINKS.rawValue)
    /// Prefill serving extension: AttnSeqParams bound (with any of 302, 305-310).
    public static let prefillSeq = Int(FM_FC_PREFILL_SEQ.rawValue)
    /// Prefill serving extension: the window of AttnSeqParams applies.
    public static let window = Int(FM_FC_WINDOW.rawValue)
    /// Prefill serving extension: q/o/lse packed, cu_seqlens_q bound.
    public static let varlenQ = Int(FM_FC_VARLEN_Q.rawValue)
    /// Prefill serving extension: k/v packed, cu_seqlens_k bound.
    public static let varlenK = Int(FM_FC_VARLEN_K.rawValue)
    /// Prefill serving extension: seqlens_k bound.
    public static let kvLens = Int(FM_FC_KV_LENS.rawValue)
    /// Prefill serving extension: k/v paged, block_table bound.
    public static let paged = Int(FM_FC_PAGED.rawValue)
    /// Prefill serving extension: the lse output bound.
    public static let hasLSE = Int(FM_FC_HAS_LSE.rawValue)
    /// Prefill serving extension: ALiBi slopes bound.
    public static let hasAlibi = Int(FM_FC_HAS_ALIBI.rawValue)
    /// Prefill: bytes per device load of the tile loaders (int): 4, 8 or 16.
    public static let tileLoadBytes = Int(FM_FC_TILE_LOAD_BYTES.rawValue)
    /// blk: BQ of the prefill that consumes the blk (int).
    public static let blkBQ = Int(FM_FC_BLK_BQ.rawValue)
    /// blk: BK of the prefill that consumes the blk (int).
    public static let blkBK = Int(FM_FC_BLK_BK.rawValue)
    /// FWHT-undo reduce: a sign bitmask is bound.
    public static let vecHasSigns = Int(FM_FC_VEC_HAS_SIGNS.rawValue)
    /// Decode: FlashAttnVecSeqParams are bound (per-sequence strides, paging).
    public static let vecSeq = Int(FM_FC_VEC_SEQ.rawValue)
    /// Decode: seqlens_k is bound (a kv length per sequence).
    public static let vecKVLens = Int(FM_FC_VEC_KV_LENS.rawValue)
    /// Decode: K/V are paged, block_table is bound.
    public static let vecPaged = Int(FM_FC_VEC_PAGED.rawValue)
    /// Decode plain reduce: sinks and FlashAttnVecReduceExtParams are bound.
    public static let vecSinks = Int(FM_FC_VEC_SINKS.rawValue)
    /// Decode plain reduce: the lse output and FlashAttnVecReduceExtParams are bound.
    public static let vecLSE = Int(FM_FC_VEC_LSE.rawValue)
    /// Decode: q, K or V is not aligned to the kernel's vector loads (it loads scalars).
    public static let vecUnaligned = Int(FM_FC_VEC_UNALIGNED.rawValue)
    /// Decode: ALiBi slopes bound (with vecSeq).
    public static let vecAlibi = Int(FM_FC_VEC_ALIBI.rawValue)
    /// Decode: q is in the K/V dtype (bound at VecBuffer.qIO), not float32.
    public static let vecQIO = Int(FM_FC_VEC_Q_IO.rawValue)
    /// Decode reduce: the output is float16 (bound at VecReduceBuffer.outF16).
    public static let vecOutF16 = Int(FM_FC_VEC_OUT_F16.rawValue)
    /// Decode reduce: the output is bfloat16 (bound at VecReduceBuffer.outBF16).
    public static let vecOutBF16 = Int(FM_FC_VEC_OUT_BF16.rawValue)
    /// kv_append: the caches are paged, block_table is bound.
    public static let appendPaged = Int(FM_FC_APPEND_PAGED.rawValue)
    /// kv_codes_decode: seqlens_k is bound.
    public static let kvqLens = Int(FM_FC_KVQ_LENS.rawValue)
    /// kv_codes_decode: the caches are paged, block_table is bound.
    public static let kvqPaged = Int(FM_FC_KVQ_PAGED.rawValue)
    /// kv_codes_decode: sinks are bound.
    public static let kvqSinks = Int(FM_FC_KVQ_SINKS.rawValue)
    /// kv_codes_decode: the lse output is bound.
    public static let kvqLSE = Int(FM_FC_KVQ_LSE.rawValue)
    /// kv_codes_append: the caches are paged, block_table is bound.
    public static let kvqAppendPaged = Int(FM_FC_KVQ_APPEND_PAGED.rawValue)
    /// kv_codes_decode: K is a dense cache, not codes.
    public static let kvqKDense = Int(FM_FC_KVQ_K_DENSE.rawValue)
    /// kv_codes_decode: V is a dense cache, not codes.
    public static let kvqVDense = Int(FM_FC_KVQ_V_DENSE.rawValue)
    /// kv_codes_append: K is a dense cache, not codes.
    public static let kvqAppendKDense = Int(FM_FC_KVQ_APPEND_K_DENSE.rawValue)
    /// kv_codes_append: V is a dense cache, not codes.
    public static let kvqAppendVDense = Int(FM_FC_KVQ_APPEND_V_DENSE.rawValue)
    /// kv_codes_decode: q/out/lse packed, cu_seqlens_q bound.
    public static let kvqVarlenQ = Int(FM_FC_KVQ_VARLEN_Q.rawValue)
    /// kv_codes_decode: key counts from cu_seqlens_k.
    public static let kvqVarlenK = Int(FM_FC_KVQ_VARLEN_K.rawValue)
    /// kv_codes_decode: partials to tmp for kv_codes_reduce, not the output.
    public static let kvqSplit = Int(FM_FC_KVQ_SPLIT.rawValue)
    /// kv_codes_decode / kv_codes_prefill: ALiBi slopes are bound.
    public static let kvqAlibi = Int(FM_FC_KVQ_ALIBI.rawValue)
    /// sdpa: a bool mask is bound.
    public static let sdpaBoolMask = Int(FM_FC_SDPA_BOOL_MASK.rawValue)
    /// sdpa: an additive mask is bound.
    public static let sdpaAdditiveMask = Int(FM_FC_SDPA_ADDITIVE_MASK.rawValue)
    /// sdpa: SdpaExtParams are bound (explicit q_offset, window).
    public static let sdpaExt = Int(FM_FC_SDPA_EXT.rawValue)
    /// sdpa: the softcap of SdpaExtParams applies.
    public static let sdpaSoftcap = Int(FM_FC_SDPA_SOFTCAP.rawValue)

    /// Every index with its header name, for the tests that tie the shaders to them.
    public static let all: [(name: String, index: Int)] = [
        ("FM_FC_ALIGN_Q", alignQ), ("FM_FC_ALIGN_K", alignK), ("FM_FC_HAS_MASK", hasMask),
        ("FM_FC_DO_CAUSAL", doCausal), ("FM_FC_HAS_BLK", hasBlk), ("FM_FC_BLK_BQ", blkBQ),
        ("FM_FC_BLK_BK", blkBK), ("FM_FC_VEC_HAS_SIGNS", vecHasSigns),
        ("FM_FC_SDPA_BOOL_MASK", sdpaBoolMask), ("FM_FC_SDPA_ADDITIVE_MASK", sdpaAdditiveMask),
        ("FM_FC_SDPA_EXT", sdpaExt), ("FM_FC_SDPA_SOFTCAP", sdpaSoftcap),
        ("FM_FC_HAS_SINKS", hasSinks), ("FM_FC_PREFILL_SEQ", prefillSeq), ("FM_FC_WINDOW", window),
        ("FM_FC_VARLEN_Q", varlenQ), ("FM_FC_VARLEN_K", varlenK), ("FM_FC_KV_LENS", kvLens),
        ("FM_FC_PAGED", paged), ("FM_FC_HAS_LSE", hasLSE), ("FM_FC_HAS_ALIBI", hasAlibi),
        ("FM_FC_TILE_LOAD_BYTES", tileLoadBytes),
        ("FM_FC_VEC_SEQ", vecSeq), ("FM_FC_VEC_KV_LENS", vecKVLens), ("FM_FC_VEC_PAGED", vecPaged),
        ("FM_FC_VEC_SINKS", vecSinks), ("FM_FC_VEC_LSE", vecLSE), ("FM_FC_VEC_UNALIGNED", vecUnaligned),
        ("FM_FC_VEC_ALIBI", vecAlibi), ("FM_FC_VEC_Q_IO", vecQIO), ("FM_FC_VEC_OUT_F16", vecOutF16),
        ("FM_FC_VEC_OUT_BF16", vecOutBF16),
        ("FM_FC_APPEND_PAGED", appendPaged),
        ("FM_FC_KVQ_LENS", kvqLens), ("FM_FC_KVQ_PAGED", kvqPaged), ("FM_FC_KVQ_SINKS", kvqSinks),
        ("FM_FC_KVQ_LSE", kvqLSE), ("FM_FC_KVQ_APPEND_PAGED", kvqAppendPaged), ("FM_FC_KVQ_K_DENSE", kvqKDense),
        ("FM_FC_KVQ_V_DENSE", kvqVDense), ("FM_FC_KVQ_APPEND_K_DENSE", kvqAppendKDense),
        ("FM_FC_KVQ_APPEND_V_DENSE", kvqAppendVDense), ("FM_FC_KVQ_VARLEN_Q", kvqVarlenQ),
        ("FM_FC_KVQ_VARLEN_K", kvqVarlenK), ("FM_FC_KVQ_SPLIT", kvqSplit),
        ("FM_FC_KVQ_ALIBI", kvqAlibi),
    ]
}

/// Buffer indices of the prefill kernels.
public enum PrefillBuffer {
    /// FM_PREFILL_BUF_Q.
    public static let q = Int(FM_PREFILL_BUF_Q.rawValue)
    /// FM_PREFILL_BUF_K.
    public static let k = Int(FM_PREFILL_BUF_K.rawValue)
    /// FM_PREFILL_BUF_V.
    public static let v = Int(FM_PREFILL_BUF_V.rawValue)
    /// FM_PREFILL_BUF_O.
    public static let out = Int(FM_PREFILL_BUF_O.rawValue)
    /// AttnParams.
    public static let params = Int(FM_PREFILL_BUF_PARAMS.rawValue)
    /// AttnMaskParams (with a mask).
    public static let maskParams = Int(FM_PREFILL_BUF_MASK_PARAMS.rawValue)
    /// FM_PREFILL_BUF_MASK.
    public static let mask = Int(FM_PREFILL_BUF_MASK.rawValue)
    /// FM_PREFILL_BUF_BLK.
    public static let blk = Int(FM_PREFILL_BUF_BLK.rawValue)
    /// AttnSeqParams (with FunctionConstantIndex.prefillSeq).
    public static let seqParams = Int(FM_PREFILL_BUF_SEQ_PARAMS.rawValue)
    /// int32 [B+1] (with varlenQ).
    public static let cuSeqlensQ = Int(FM_PREFILL_BUF_CU_SEQLENS_Q.rawValue)
    /// int32 [B+1] (with varlenK).
    public static let cuSeqlensK = Int(FM_PREFILL_BUF_CU_SEQLENS_K.rawValue)
    /// int32 [B] (with kvLens).
    public static let seqlensK = Int(FM_PREFILL_BUF_SEQLENS_K.rawValue)
    /// int32 [B, max_pages] (with paged).
    public static let blockTable = Int(FM_PREFILL_BUF_BLOCK_TABLE.rawValue)
    /// float32 [H] (with hasSinks).
    public static let sinks = Int(FM_PREFILL_BUF_SINKS.rawValue)
    /// float32 out (with hasLSE).
    public static let lse = Int(FM_PREFILL_BUF_LSE.rawValue)
    /// float32 [B, H] ALiBi slopes (with hasAlibi).
    public static let alibi = Int(FM_PREFILL_BUF_ALIBI.rawValue)
}

/// Buffer indices of the blk pre-pass.
public enum BlkBuffer {
    /// FM_BLK_BUF_MASK.
    public static let mask = Int(FM_BLK_BUF_MASK.rawValue)
    /// FM_BLK_BUF_OUT.
    public static let out = Int(FM_BLK_BUF_OUT.rawValue)
    /// BlkParams.
    public static let params = Int(FM_BLK_BUF_PARAMS.rawValue)
}

/// Buffer indices of the mask builder.
public enum MaskBuilderBuffer {
    /// FM_MASKB_BUF_OUT.
    public static let out = Int(FM_MASKB_BUF_OUT.rawValue)
    /// MaskParams.
    public static let params = Int(FM_MASKB_BUF_PARAMS.rawValue)
}

/// Buffer indices of the decode kernel.
public enum VecBuffer {
    /// FlashAttnVecParams.
    public static let params = Int(FM_VEC_BUF_PARAMS.rawValue)
    /// FM_VEC_BUF_Q.
    public static let q = Int(FM_VEC_BUF_Q.rawValue)
    /// FM_VEC_BUF_K.
    public static let k = Int(FM_VEC_BUF_K.rawValue)
    /// FM_VEC_BUF_V.
    public static let v = Int(FM_VEC_BUF_V.rawValue)
    /// FM_VEC_BUF_TMP.
    public static let tmp = Int(FM_VEC_BUF_TMP.rawValue)
    /// FlashAttnVecSeqParams (with FunctionConstantIndex.vecSeq).
    public static let seqParams = Int(FM_VEC_BUF_SEQ_PARAMS.rawValue)
    /// int32 [B] kv lengths (with FunctionConstantIndex.vecKVLens).
    public static let seqlensK = Int(FM_VEC_BUF_SEQLENS_K.rawValue)
    /// int32 [B, max_pages] (with FunctionConstantIndex.vecPaged).
    public static let blockTable = Int(FM_VEC_BUF_BLOCK_TABLE.rawValue)
    /// float32 [B * H] ALiBi slopes (with vecAlibi).
    public static let alibi = Int(FM_VEC_BUF_ALIBI.rawValue)
    /// q in the K/V dtype (with FunctionConstantIndex.vecQIO).
    public static let qIO = Int(FM_VEC_BUF_Q_IO.rawValue)
}

/// Buffer indices of the decode reduce kernels.
public enum VecReduceBuffer {
    /// FlashAttnVecReduceParams.
    public static let params = Int(FM_VEC_REDUCE_BUF_PARAMS.rawValue)
    /// FM_VEC_REDUCE_BUF_TMP.
    public static let tmp = Int(FM_VEC_REDUCE_BUF_TMP.rawValue)
    /// FM_VEC_REDUCE_BUF_OUT.
    public static let out = Int(FM_VEC_REDUCE_BUF_OUT.rawValue)
    /// The workgroup count, a uint32.
    public static let nwg = Int(FM_VEC_REDUCE_BUF_NWG.rawValue)
    /// The FWHT sign bitmask (with FunctionConstantIndex.vecHasSigns).
    public static let signs = Int(FM_VEC_REDUCE_BUF_SIGNS.rawValue)
    /// float32 [H] sink logits (with FunctionConstantIndex.vecSinks).
    public static let sinks = Int(FM_VEC_REDUCE_BUF_SINKS.rawValue)
    /// float32 [rows] lse output (with FunctionConstantIndex.vecLSE).
    public static let lse = Int(FM_VEC_REDUCE_BUF_LSE.rawValue)
    /// FlashAttnVecReduceExtParams (with vecSinks or vecLSE).
    public static let ext = Int(FM_VEC_REDUCE_BUF_EXT.rawValue)
    /// float16 output (with FunctionConstantIndex.vecOutF16).
    public static let outF16 = Int(FM_VEC_REDUCE_BUF_OUT_F16.rawValue)
    /// bfloat16 output (with FunctionConstantIndex.vecOutBF16).
    public static let outBF16 = Int(FM_VEC_REDUCE_BUF_OUT_BF16.rawValue)
}

/// Buffer indices of the rotary kernels.
public enum RotaryBuffer {
    /// RotaryParams.
    public static let params = Int(FM_ROT_BUF_PARAMS.rawValue)
    /// x [B, L, H, D].
    public static let x = Int(FM_ROT_BUF_X.rawValue)
    /// cos [seqlen_ro, rotary_dim / 2].
    public static let cos = Int(FM_ROT_BUF_COS.rawValue)
    /// sin [seqlen_ro, rotary_dim / 2].
    public static let sin = Int(FM_ROT_BUF_SIN.rawValue)
    /// int32 [B]: each sequence's first position.
    public static let offsets = Int(FM_ROT_BUF_OFFSETS.rawValue)
    /// out [B, L, H, D], x's dtype.
    public static let out = Int(FM_ROT_BUF_OUT.rawValue)
}

/// Buffer indices of the kv_append kernels.
public enum KVAppendBuffer {
    /// KVAppendParams.
    public static let params = Int(FM_APPEND_BUF_PARAMS.rawValue)
    /// FM_APPEND_BUF_K_NEW.
    public static let kNew = Int(FM_APPEND_BUF_K_NEW.rawValue)
    /// FM_APPEND_BUF_V_NEW.
    public static let vNew = Int(FM_APPEND_BUF_V_NEW.rawValue)
    /// FM_APPEND_BUF_K_CACHE.
    public static let kCache = Int(FM_APPEND_BUF_K_CACHE.rawValue)
    /// FM_APPEND_BUF_V_CACHE.
    public static let vCache = Int(FM_APPEND_BUF_V_CACHE.rawValue)
    /// int32 [B]: the row each sequence's first new token goes to.
    public static let seqlens = Int(FM_APPEND_BUF_SEQLENS.rawValue)
    /// int32 [B, max_pages] (with FunctionConstantIndex.appendPaged).
    public static let blockTable = Int(FM_APPEND_BUF_BLOCK_TABLE.rawValue)
}

/// Buffer indices of the sdpa kernels.
public enum SdpaBuffer {
    /// FM_SDPA_BUF_Q.
    public static let q = Int(FM_SDPA_BUF_Q.rawValue)
    /// FM_SDPA_BUF_K.
    public static let k = Int(FM_SDPA_BUF_K.rawValue)
    /// FM_SDPA_BUF_V.
    public static let v = Int(FM_SDPA_BUF_V.rawValue)
    /// FM_SDPA_BUF_O.
    public static let out = Int(FM_SDPA_BUF_O.rawValue)
    /// SdpaParams.
    public static let params = Int(FM_SDPA_BUF_PARAMS.rawValue)
    /// AttnMaskParams (with a mask).
    public static let maskParams = Int(FM_SDPA_BUF_MASK_PARAMS.rawValue)
    /// FM_SDPA_BUF_ADDITIVE_MASK.
    public static let additiveMask = Int(FM_SDPA_BUF_ADDITIVE_MASK.rawValue)
    /// FM_SDPA_BUF_BOOL_MASK.
    public static let boolMask = Int(FM_SDPA_BUF_BOOL_MASK.rawValue)
    /// SdpaExtParams (with FunctionConstantIndex.sdpaExt).
    public static let ext = Int(FM_SDPA_BUF_EXT.rawValue)
}

/// The kind of mask a prefill or sdpa call carries (FMMaskKind).
public enum MaskKind: Int32, CaseIterable, Sendable {
    case none = 0, additive = 1, bool = 2
}

/// The decode mask (FMVecMaskType); the query sits at kv_len - 1.
public enum VecMaskType: Int, CaseIterable, Sendable {
    case none = 0, causal = 1, window = 2
}
