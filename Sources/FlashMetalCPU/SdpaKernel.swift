import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `sdpa` / `sdpa_f16` / `sdpa_bf16` on the cpu: one work item per
/// (batch, head, q tile).
final class SdpaKernel: CPUKernel {
    let name: String
    let maskKind: Int32
    /// SdpaExtParams bound at buffer 8 (explicit q_offset, window, softcap):
    /// a specialised path must handle them or leave the call to `run`'s general one.
    let hasExt: Bool
    let useSoftcap: Bool

    init(_ key: PipelineKey) throws {
        name = key.kernel
        let boolMask = try key.constants.requireBool(SdpaDispatcher.boolMaskConstant, kernel: name)
        let additive = try key.constants.requireBool(SdpaDispatcher.additiveMaskConstant, kernel: name)
        maskKind = Int32(boolMask ? FM_MASK_BOOL : additive ? FM_MASK_ADDITIVE : FM_MASK_NONE)
        hasExt = try key.constants.requireBool(SdpaDispatcher.extConstant, kernel: name)
        useSoftcap = try key.constants.requireBool(SdpaDispatcher.softcapConstant, kernel: name)
    }

    private var dtype: Int32 {
        switch name {
        case "sdpa_bf16": return DType.bf16.rawValue
        case "sdpa_f16": return DType.f16.rawValue
        default: return DType.f32.rawValue
        }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(4, as: SdpaParams.self)
        var ext = hasExt ? try d.params(SdpaDispatcher.extBuffer, as: SdpaExtParams.self) : SdpaExtParams()
        let q = try d.buffer(0)
        let k = UnsafeRawPointer(try d.buffer(1).data)
        let v = UnsafeRawPointer(try d.buffer(2).data)
        let o = try d.buffer(3).data
        let qd = UnsafeRawPointer(q.data)
        var mp = AttnMaskParams()
        var mask: UnsafeRawPointer? = nil
        if maskKind != Int32(FM_MASK_NONE) {
            mp = try d.params(5, as: AttnMaskParams.self)
            mask = UnsafeRawPointer(try d.buffer(maskKind == Int32(FM_MASK_BOOL) ? 7 : 6).data)
        }
        let dtype = self.dtype
        let (nb, nh, nt) = (d.grid.x, d.grid.y, d.grid.z)
        let tileQ = Int32(d.threadgroup.x)
        let floats = fm_cpu_sdpa_scratch_floats(Int32(p.head_dim))
        let workers = max(min(pool.threads, d.grid.count), 1)
        let scratch = UnsafeMutablePointer<Float>.allocate(capacity: floats * workers)
        defer { scratch.deallocate() }
        let kind = maskKind, withExt = hasExt
        let softcap: Int32 = useSoftcap ? 1 : 0
        withUnsafePointer(to: &p) { pp in
            withUnsafePointer(to: &mp) { mpp in
                withUnsafePointer(to: &ext) { ep in
                    let extPtr: UnsafePointer<SdpaExtParams>? = withExt ? ep : nil
                    pool.forEach(nb * nh * nt) { w, item in
                        let t = item % nt, h = (item / nt) % nh, b = item / (nt * nh)
                        fm_cpu_sdpa_tile(pp, extPtr, softcap, qd, k, v, o, dtype, mask, mpp, kind, Int64(b),
                                         Int64(h), Int64(t), tileQ, scratch + w * floats)
                    }
                }
            }
        }
    }
}
