import CFlashMetal
import FlashMetalCore
import FlashMetalCPU

/// Whether a SIGINT may cut short a call of the main thread (1) or never
/// (0); returns the previous setting. FLASHMETAL_INTERRUPT=0 starts it off.
@_cdecl("fm_set_interrupt")
public func fm_set_interrupt(_ enabled: Int32) -> Int32 {
    CPUBackend.setInterruptible(enabled != 0) ? 1 : 0
}

/// The cpu worker pool's thread count, as the pool decided it.
@_cdecl("fm_num_threads")
public func fm_num_threads() -> Int32 {
    Int32(CPUBackend.poolThreads)
}

/// Wakes the cpu worker pool's sleeping workers ahead of a call about to be
/// made (a host-side caller's argument handling then overlaps their wake-up).
@_cdecl("fm_prepare_workers")
public func fm_prepare_workers() {
    CPUBackend.prepareWorkers()
}

// The capability queries: what the kernels take, read from the capability
// tables so no caller keeps its own copy.

/// The head dims that have a kernel for `op` ("flash_attn_prefill",
/// "flash_attn_prefill_f32" for its float32 I/O, "flash_attn_decode", alias
/// "flash_attn_vec", or "kv_codec", the quantized-KV codec), ascending, from
/// the capability tables: the Python package routes by them instead of
/// keeping its own list.
@_cdecl("fm_supported_head_dims")
public func fm_supported_head_dims(_ op: UnsafePointer<CChar>?, _ out: UnsafeMutablePointer<Int32>?, _ cap: Int,
                                   _ count: UnsafeMutablePointer<Int>?,
                                   _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let name = op.map { String(cString: $0) } ?? ""
        let dims: [Int]
        switch name {
        case PrefillDispatcher.op: dims = PrefillCapability.headDims
        case PrefillDispatcher.f32Name: dims = PrefillCapability.headDims(io: .f32)
        case VecDispatcher.publicName, VecDispatcher.op: dims = VecCapability.headDims
        case KVCodec.op: dims = KVCodec.headDims
        default:
            throw FlashMetalError.value(
                "supported_head_dims", "op must be '\(PrefillDispatcher.op)', '\(PrefillDispatcher.f32Name)', "
                    + "'\(VecDispatcher.publicName)' (alias '\(VecDispatcher.op)') or '\(KVCodec.op)', got '\(name)'",
                arg: "op")
        }
        guard let count = count else { throw FlashMetalError.value("supported_head_dims", "count is null", arg: "count") }
        count.pointee = dims.count
        if let out = out {
            for (i, d) in dims.prefix(max(cap, 0)).enumerated() { out[i] = Int32(d) }
        }
    }
}

/// Whether `op`'s kernels ("flash_attn_prefill", "flash_attn_prefill_f32"
/// for its float32 I/O, or "flash_attn_decode", alias "flash_attn_vec") run
/// q/k of head dim `d` with v (and the output) of `dv`: *out 1 or 0, by the
/// rules the dispatchers validate (PrefillCapability.runs, VecCapability.runs),
/// so the Python package routes by them.
@_cdecl("fm_runs_head_dims")
public func fm_runs_head_dims(_ op: UnsafePointer<CChar>?, _ d: Int32, _ dv: Int32, _ out: UnsafeMutablePointer<Int32>?,
                              _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let name = op.map { String(cString: $0) } ?? ""
        let (d, dv) = (Int(d), Int(dv))
        let runs: Bool
        switch name {
        case PrefillDispatcher.op: runs = PrefillCapability.runs(io: .bf16, headDim: d, headDimV: dv)
        case PrefillDispatcher.f32Name: runs = PrefillCapability.runs(io: .f32, headDim: d, headDimV: dv)
        case VecDispatcher.publicName, VecDispatcher.op: runs = VecCapability.runs(headDim: d, headDimV: dv)
        default:
            throw FlashMetalError.value(
                "runs_head_dims", "op must be '\(PrefillDispatcher.op)', '\(PrefillDispatcher.f32Name)' or "
                    + "'\(VecDispatcher.publicName)' (alias '\(VecDispatcher.op)'), got '\(name)'", arg: "op")
        }
        guard let out = out else { throw FlashMetalError.value("runs_head_dims", "out is null", arg: "out") }
        out.pointee = runs ? 1 : 0
    }
}

/// The largest head dim `op` ("flash_attn_prefill", "flash_attn_decode"
/// (alias "flash_attn_vec") or "sdpa") takes: the front door routes by it (sdpa's is not a list).
@_cdecl("fm_max_head_dim")
public func fm_max_head_dim(_ op: UnsafePointer<CChar>?, _ out: UnsafeMutablePointer<Int32>?,
                            _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let name = op.map { String(cString: $0) } ?? ""
        let dim: Int
        switch name {
        case PrefillDispatcher.op: dim = PrefillCapability.headDims.max() ?? 0
        case VecDispatcher.publicName, VecDispatcher.op: dim = VecCapability.headDims.max() ?? 0
        case SdpaDispatcher.op: dim = SdpaCapability.maxHeadDim
        default:
            throw FlashMetalError.value(
                "max_head_dim", "op must be '\(PrefillDispatcher.op)', '\(VecDispatcher.publicName)' (alias "
                    + "'\(VecDispatcher.op)') or '\(SdpaDispatcher.op)', got '\(name)'", arg: "op")
        }
        guard let out = out else { throw FlashMetalError.value("max_head_dim", "out is null", arg: "out") }
        out.pointee = Int32(dim)
    }
}

/// Every kernel the capability tables imply, one a line: its name, its
/// template function and the function's template arguments, separated by
/// spaces (KernelSpec.all and KernelSpec.instantiation), as a static C
/// string. tools/gen_instantiations.py writes the shaders' INSTANTIATE_KERNEL
/// lines from it, so no shader restates a table.
@_cdecl("fm_kernel_instantiations")
public func fm_kernel_instantiations() -> UnsafePointer<CChar> {
    kernelInstantiations
}

private let kernelInstantiations = staticCString(KernelSpec.all.map { spec in
    let (function, args) = spec.instantiation
    return ([spec.name, function] + args).joined(separator: " ")
}.joined(separator: "\n"))
