import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `sdpa` / `sdpa_f16` / `sdpa_bf16` on the cpu: one work item per
/// (batch, head, q tile).
final class SdpaKernel: CPUKernel {
    let name: String
    let io: DType
    let maskKind: MaskKind
    /// SdpaExtParams bound at SdpaBuffer.ext (explicit q_offset, window, softcap).
    let hasExt: Bool
    let useSoftcap: Bool
    private let fastPath = SdpaFastPath()

    init(_ key: PipelineKey, io: DType) throws {
        name = key.kernel
        self.io = io
        let boolMask = try key.constants.requireBool(FunctionConstantIndex.sdpaBoolMask, kernel: name)
        let additive = try key.constants.requireBool(FunctionConstantIndex.sdpaAdditiveMask, kernel: name)
        maskKind = boolMask ? .bool : additive ? .additive : .none
        hasExt = try key.constants.requireBool(FunctionConstantIndex.sdpaExt, kernel: name)
        useSoftcap = try key.constants.requireBool(FunctionConstantIndex.sdpaSoftcap, kernel: name)
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var ext = hasExt ? try d.params(SdpaBuffer.ext, as: SdpaExtParams.self) : SdpaExtParams()
        if try fastPath.run(d, maskKind: maskKind, ext: hasExt ? ext : nil, softcap: useSoftcap, pool: pool) { return }
        var p = try d.params(SdpaBuffer.params, as: SdpaParams.self)
        let q = try d.buffer(SdpaBuffer.q)
        let k = UnsafeRawPointer(try d.buffer(SdpaBuffer.k).data)
        let v = UnsafeRawPointer(try d.buffer(SdpaBuffer.v).data)
        let o = try d.buffer(SdpaBuffer.out).data
        let qd = UnsafeRawPointer(q.data)
        var mp = AttnMaskParams()
        var mask: UnsafeRawPointer? = nil
        if maskKind != .none {
            mp = try d.params(SdpaBuffer.maskParams, as: AttnMaskParams.self)
            mask = UnsafeRawPointer(try d.buffer(maskKind == .bool ? SdpaBuffer.boolMask : SdpaBuffer.additiveMask).data)
        }
        let dtype = io.rawValue
        let (nb, nh, nt) = (d.grid.x, d.grid.y, d.grid.z)
        let tileQ = Int32(d.threadgroup.x)
        let floats = fm_cpu_sdpa_scratch_floats(max(Int32(p.head_dim), hasExt ? ext.head_dim_v : 0))
        let workers = max(min(pool.threads, d.grid.count), 1)
        let scratch = try HostMemory.allocate(Float.self, count: floats * workers, op: name, what: "sdpa scratch")
        defer { HostMemory.free(scratch) }
        let kind = maskKind.rawValue, withExt = hasExt
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
