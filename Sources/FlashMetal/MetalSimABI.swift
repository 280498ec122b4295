import CFlashMetal
import FlashMetalCore
#if canImport(Metal) && os(Linux)
import Metal
#endif

/// fm_metal_sim_counters of flashmetal.h: the metal-sim runtime's counters
/// in FMMetalSimCounter order; an error where metal-sim is not built in.
@_cdecl("fm_metal_sim_counters")
public func fm_metal_sim_counters(_ out: UnsafeMutablePointer<Int64>?, _ cap: Int,
                                  _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        #if canImport(Metal) && os(Linux)
        let c = MetalSim.counters
        var values = [Int](repeating: 0, count: Int(FM_MSIM_COUNTER_COUNT.rawValue))
        func set(_ k: FMMetalSimCounter, _ v: Int) { values[Int(k.rawValue)] = v }
        set(FM_MSIM_COMMAND_BUFFERS, c.commandBuffers)
        set(FM_MSIM_COMMITS, c.commits)
        set(FM_MSIM_ENCODERS, c.encoders)
        set(FM_MSIM_DISPATCHES, c.dispatches)
        set(FM_MSIM_BARRIERS, c.barriers)
        set(FM_MSIM_BYTES_WRAPPED, c.bytesWrapped)
        set(FM_MSIM_BYTES_COPIED_IN, c.bytesCopiedIn)
        set(FM_MSIM_BYTES_COPIED_OUT, c.bytesCopiedOut)
        set(FM_MSIM_VIOLATIONS, c.violations)
        set(FM_MSIM_LIVE_COMMAND_BUFFERS, c.liveCommandBuffers)
        set(FM_MSIM_NO_COPY_REFUSED, c.noCopyRefused)
        set(FM_MSIM_WRAPS, c.wraps)
        set(FM_MSIM_COPY_BUFFERS, c.copyBuffers)
        guard let out, cap >= values.count else {
            throw FlashMetalError.value("metal_sim_counters", "out must hold \(values.count) values, cap is \(cap)")
        }
        for (i, v) in values.enumerated() { out[i] = Int64(v) }
        #else
        throw FlashMetalError.value("metal_sim_counters", "this library has no metal-sim runtime (Linux builds only)")
        #endif
    }
}

/// fm_metal_sim_last_violation of flashmetal.h: the last Metal rule the
/// metal-sim runtime saw broken ("" for none).
@_cdecl("fm_metal_sim_last_violation")
public func fm_metal_sim_last_violation(_ buf: UnsafeMutablePointer<CChar>?, _ len: Int) -> Int32 {
    #if canImport(Metal) && os(Linux)
    writeMessage(MetalSim.lastViolation?.description ?? "", buf, len)
    #else
    writeMessage("", buf, len)
    #endif
    return Int32(FM_OK.rawValue)
}
