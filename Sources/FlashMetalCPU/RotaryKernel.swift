import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `rotary_*` on the cpu (rotary.c): one work item per (sequence, row) of
/// the grid (L, H, B), rotating every head of the row.
final class RotaryKernel: CPUKernel {
    let xType: DType, tableType: DType

    init(_ key: PipelineKey) {
        if case let .rotary(x, tables) = key.spec { (xType, tableType) = (x, tables) } else { (xType, tableType) = (.f32, .f32) }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(RotaryBuffer.params, as: RotaryParams.self)
        let x = UnsafeRawPointer(try d.buffer(RotaryBuffer.x).data)
        let cos = UnsafeRawPointer(try d.buffer(RotaryBuffer.cos).data)
        let sin = UnsafeRawPointer(try d.buffer(RotaryBuffer.sin).data)
        let offsets = UnsafePointer(try d.buffer(RotaryBuffer.offsets).data.assumingMemoryBound(to: Int32.self))
        let out = try d.buffer(RotaryBuffer.out).data
        let (rows, batch) = (d.grid.x, d.grid.z)
        let (xt, ct) = (Int32(xType.rawValue), Int32(tableType.rawValue))
        withUnsafePointer(to: &p) { pp in
            pool.forEach(batch * rows) { _, item in
                fm_cpu_rotary_row(pp, x, cos, sin, offsets, out, xt, ct, Int64(item / rows), Int64(item % rows))
            }
        }
    }
}
