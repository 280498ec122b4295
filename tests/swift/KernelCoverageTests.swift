import FlashMetalCPU
import FlashMetalCore
import FlashMetalShaders
import FlashMetalSimBackend
import XCTest

/// Every kernel name a dispatcher can produce exists on every backend: in the
/// embedded Metal sources, in the simulator and in the cpu backend's table;
/// and every embedded kernel is one a dispatcher produces.
final class KernelCoverageTests: XCTestCase {
    static let dispatched: Set<String> = Set(
        PrefillDispatcher.allKernelNames + BlkDispatcher.allKernelNames + MaskDispatcher.allKernelNames
            + VecDispatcher.mainKernelNames + VecDispatcher.reduceKernelNames + SdpaDispatcher.allKernelNames)
    static let selfTests: Set<String> = ["fm_selftest_reduce"]

    func testSeedNamesAreAmongThem() {
        for name in ["flash_attn_prefill_bf16_d256", "flash_attn_prefill_f16_d64_boolmask",
                     "flash_attn_prefill_blk_bf16", "flash_attn_vec_dk256", "flash_attn_vec_f16kv_dk512",
                     "flash_attn_vec_reduce_dk512", "flash_attn_vec_reduce_tq_hb_undo_dk256", "sdpa", "sdpa_bf16"] {
            XCTAssertTrue(Self.dispatched.contains(name), name)
        }
    }

    func testMetalSourcesDefineEveryDispatchedKernel() {
        let embedded = Set(EmbeddedShaders.kernelFiles.keys)
        XCTAssertEqual(Self.dispatched.subtracting(embedded), [], "dispatched but not in Resources/shaders")
        XCTAssertEqual(embedded.subtracting(Self.dispatched).subtracting(Self.selfTests), [],
                       "in Resources/shaders but no dispatcher produces it")
    }

    func testSimulatorHasEveryDispatchedKernel() {
        let sim = Set(SimBackend.kernelNames)
        XCTAssertEqual(Self.dispatched.subtracting(sim), [], "not compiled into the simulator")
        XCTAssertEqual(Set(EmbeddedShaders.kernelFiles.keys), sim, "sim and embedded sources disagree")
    }

    func testCPUBackendKnowsEveryDispatchedKernel() {
        let cpu = CPUBackend()
        for name in Self.dispatched.sorted() {
            do {
                _ = try cpu.makePipeline(PipelineKey(kernel: name, constants: FunctionConstants()))
            } catch {
                // Missing constants are fine here; an unknown name is not.
                XCTAssertFalse("\(error)".contains("unknown kernel"), "\(name): \(error)")
            }
        }
    }
}
