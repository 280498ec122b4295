/// The typed identity of one Metal kernel (one `INSTANTIATE_KERNEL` line):
/// the op and the facts that select its instantiation. The kernel's name is
/// derived from it, never parsed back; backends switch on it.
public enum KernelSpec: Hashable, Sendable, CustomStringConvertible {
    /// `flash_attn_prefill_{bf16,f16,f32}_d{D}[_boolmask]`.
    case prefill(io: DType, headDim: Int, boolMask: Bool)
    /// `flash_attn_prefill_blk_{bf16,f16,f32,bool}`: the tile-skip pre-pass.
    case blk(mask: DType)
    /// `flash_attn_prefill_mask_{bf16,f16}`: the causal/window mask builder.
    case maskBuilder(out: DType)
    /// `flash_attn_vec[_{f16,bf16}kv]_dk{D}`: split-KV decode.
    case vec(kv: DType, headDim: Int)
    /// `flash_attn_vec_reduce_dk{D}`, or with `fwht` the fused FWHT sign undo
    /// `flash_attn_vec_reduce_tq_hb_undo_dk{D}`.
    case vecReduce(headDim: Int, fwht: Bool)
    /// `sdpa` (float32) / `sdpa_{dtype}`: simple fused SDPA.
    case sdpa(io: DType)
    /// `kv_append_{f32,f16,bf16}`: new K/V rows written into a (paged) cache.
    case kvAppend(cache: DType)
    /// `kv_encode_{f32,f16,bf16}`: rows to quantized-KV codes and norms.
    case kvEncode(input: DType)
    /// `kv_dequantize_f32`: quantized-KV codes and norms back to float32 rows.
    case kvDequantize
    /// `kv_codes_decode_{f32,f16kv,bf16kv,f16,bf16}`: attention over
    /// quantized K and V caches, one side possibly a dense cache of `dense`.
    /// q and the output are of `io`: float32 (f32: no dense side, or a dense
    /// float32 one; f16kv, bf16kv: a dense side of that dtype), or a 16-bit
    /// dtype equal to `dense` (f16, bf16: any dense side of it too).
    case kvCodesDecode(io: DType, dense: DType)
    /// `kv_codes_prefill_*` (kv_codes_decode's names): kv_codes_decode's
    /// attention for many query rows, each key tile decoded once into
    /// threadgroup memory.
    case kvCodesPrefill(io: DType, dense: DType)
    /// `kv_codes_reduce_{f32,f16,bf16}`: a split kv_codes_decode's partials
    /// merged, the rotation undone, into an output of `io`.
    case kvCodesReduce(io: DType)
    /// `kv_codes_append_{f32,f16,bf16}`: new K/V rows encoded into quantized caches.
    case kvCodesAppend(input: DType)
    /// `rotary_{x}_{cs}`: rotary embedding of x (x's dtype) with cos/sin
    /// tables of `tables`.
    case rotary(x: DType, tables: DType)
    /// `fm_selftest_reduce` (sim_selftest.metal): the simulator's own test
    /// kernel. No op dispatches it and only the sim backend runs it.
    case simSelftest

    /// The kernel's name in the shaders, the simulator and the pipeline cache.
    public var name: String {
        switch self {
        case let .prefill(io, d, boolMask):
            return "flash_attn_prefill_\(io.kernelSuffix)_d\(d)" + (boolMask ? "_boolmask" : "")
        case let .blk(m): return "flash_attn_prefill_blk_\(m.kernelSuffix)"
        case let .maskBuilder(o): return "flash_attn_prefill_mask_\(o.kernelSuffix)"
        case let .vec(kv, d): return "flash_attn_vec_" + (kv == .f32 ? "" : "\(kv.kernelSuffix)kv_") + "dk\(d)"
        case let .vecReduce(d, fwht): return "flash_attn_vec_reduce_" + (fwht ? "tq_hb_undo_" : "") + "dk\(d)"
        case let .sdpa(io): return io == .f32 ? "sdpa" : "sdpa_\(io.kernelSuffix)"
        case let .kvAppend(c): return "kv_append_\(c.kernelSuffix)"
        case let .kvEncode(x): return "kv_encode_\(x.kernelSuffix)"
        case .kvDequantize: return "kv_dequantize_f32"
        case let .kvCodesDecode(io, dense): return "kv_codes_decode_" + Self.codesSuffix(io: io, dense: dense)
        case let .kvCodesPrefill(io, dense): return "kv_codes_prefill_" + Self.codesSuffix(io: io, dense: dense)
        case let .kvCodesReduce(io): return "kv_codes_reduce_\(io.kernelSuffix)"
        case let .kvCodesAppend(x): return "kv_codes_append_\(x.kernelSuffix)"
        case let .rotary(x, c): return "rotary_\(x.kernelSuffix)_\(c.kernelSuffix)"
        case .simSelftest: return "fm_selftest_reduce"
        }
    }

    /// The kernel name.
    public var description: String { name }

    /// The name suffix of a kernel over codes with q/out of `io` and a dense
    /// side of `dense`: `f32`, `f16kv`, `bf16kv` for float32 q/out, else
    /// io's own (dense is then io).
    static func codesSuffix(io: DType, dense: DType) -> String {
        if io != .f32 { return io.kernelSuffix }
        return dense == .f32 ? "f32" : "\(dense.kernelSuffix)kv"
    }

    /// Every kernel the library dispatches, enumerated from the capability
    /// tables; the shaders must instantiate exactly these (a test checks it).
    public static var all: [KernelSpec] {
        PrefillCapability.kernels + BlkCapability.kernels + MaskBuilderCapability.kernels
            + VecCapability.kernels + SdpaCapability.kernels + KVAppendCapability.kernels
            + KVCodecCapability.kernels + RotaryCapability.kernels
    }

    /// What the kernel's `INSTANTIATE_KERNEL(name, function, args...)` line in
    /// Resources/shaders must say: the template function and its arguments
    /// (MSL type names and integers), derived from the capability tables.
    public var instantiation: (function: String, args: [String]) {
        switch self {
        case let .prefill(io, d, boolMask):
            let g = PrefillCapability.kernelGeometry(io: io, headDim: d)!
            let args = [io.mslName, boolMask ? DType.bool.mslName : io.mslName,
                        "\(g.bq)", "\(g.bk)", "\(d)", "\(g.wm)", "\(g.wn)"]
            let function = io == .f32 && PrefillCapability.f32SplitGeometry[d] != nil
                ? "flash_attn_prefill_split" : "flash_attn_prefill"
            // The blk tile, where it is not the kernel's own, then v's head
            // dim, where it is not the tile width.
            let blk = PrefillCapability.geometry[d]!
            let dv = PrefillCapability.valueHeadDim[d]
            if blk.bq == g.bq && blk.bk == g.bk && dv == nil { return (function, args) }
            return (function, args + ["\(blk.bq)", "\(blk.bk)"] + (dv.map { ["\($0)"] } ?? []))
        case let .blk(m): return ("flash_attn_prefill_blk", [m.mslName])
        case let .maskBuilder(o): return ("flash_attn_prefill_mask", [o.mslName])
        case let .vec(kv, d): return ("flash_attn_vec", [kv.mslName, "\(d)"])
        case let .vecReduce(d, fwht):
            return (fwht ? "flash_attn_vec_reduce_tq_hb_undo" : "flash_attn_vec_reduce", ["\(d)"])
        case let .sdpa(io): return ("sdpa", [io.mslName])
        // The element type and its bits, which the kernel moves: a copy, never a conversion.
        case let .kvAppend(c): return ("kv_append", [c.mslName, c.byteSize == 4 ? "uint" : "ushort"])
        case let .kvEncode(x): return ("kv_encode", [x.mslName])
        case .kvDequantize: return ("kv_dequantize", [DType.f32.mslName])
        case let .kvCodesDecode(io, dense): return ("kv_codes_decode", [io.mslName, dense.mslName])
        case let .kvCodesPrefill(io, dense): return ("kv_codes_prefill", [io.mslName, dense.mslName])
        case let .kvCodesReduce(io): return ("kv_codes_reduce", [io.mslName])
        case let .kvCodesAppend(x): return ("kv_codes_append", [x.mslName, x.byteSize == 4 ? "uint" : "ushort"])
        case let .rotary(x, c): return ("rotary", [x.mslName, c.mslName])
        case .simSelftest: return ("selftest_reduce", ["float"])
        }
    }
}

extension DType {
    /// The dtype as kernel names spell it (`bf16` in `sdpa_bf16`).
    var kernelSuffix: String {
        switch self {
        case .f32: return "f32"
        case .f16: return "f16"
        case .bf16: return "bf16"
        case .bool: return "bool"
        case .u8: return "u8"
        case .i32: return "i32"
        }
    }

    /// The dtype as the kernels read it in MSL. A bool buffer is read as its
    /// bytes, any nonzero one true: a `bool` load of a byte other than 0/1 (a
    /// C caller may pass one) is undefined.
    var mslName: String {
        switch self {
        case .f32: return "float"
        case .f16: return "half"
        case .bf16: return "bfloat"
        case .bool: return "uchar"
        case .u8: return "uchar"
        case .i32: return "int"
        }
    }
}
