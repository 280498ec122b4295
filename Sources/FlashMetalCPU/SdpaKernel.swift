import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `sdpa` / `sdpa_bf16` on the cpu: one work item per (batch, head, q tile).
final class SdpaKernel: CPUKernel {
    let name: String

    init(_ key: PipelineKey) { name = key.kernel }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(4, as: SdpaParams.self)
        let q = try d.buffer(0)
        let k = UnsafeRawPointer(try d.buffer(1).data)
        let v = UnsafeRawPointer(try d.buffer(2).data)
        let o = try d.buffer(3).data
        let qd = UnsafeRawPointer(q.data)
        let dtype = name == "sdpa_bf16" ? DType.bf16.rawValue : DType.f32.rawValue
        let (nb, nh, nt) = (d.grid.x, d.grid.y, d.grid.z)
        let tileQ = Int32(d.threadgroup.x)
        let floats = fm_cpu_sdpa_scratch_floats(Int32(p.head_dim))
        let workers = max(min(pool.threads, d.grid.count), 1)
        let scratch = UnsafeMutablePointer<Float>.allocate(capacity: floats * workers)
        defer { scratch.deallocate() }
        withUnsafePointer(to: &p) { pp in
            pool.forEach(nb * nh * nt) { w, item in
                let t = item % nt, h = (item / nt) % nh, b = item / (nt * nh)
                fm_cpu_sdpa_tile(pp, qd, k, v, o, dtype, Int64(b), Int64(h), Int64(t), tileQ,
                                 scratch + w * floats)
            }
        }
    }
}
