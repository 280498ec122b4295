import CFlashMetal
import FlashMetalCPU
import FlashMetalCore
import FlashMetalShaders
import FlashMetalSimBackend
import XCTest

/// "Every kernel" is KernelSpec.all, enumerated from the capability tables.
/// The embedded Metal sources must instantiate exactly those kernels, each
/// with the template arguments the table implies (tile geometry, head dim,
/// types); the simulator and the cpu backend must run every one.
final class KernelCoverageTests: XCTestCase {
    static let specs = KernelSpec.all
    static let selfTests: Set<String> = [KernelSpec.simSelftest.name]

    /// `INSTANTIATE_KERNEL("name", function, args...)` lines of the embedded sources.
    static var instantiations: [String: (function: String, args: [String])] {
        var found: [String: (function: String, args: [String])] = [:]
        for (_, text) in EmbeddedShaders.sources {
            for line in text.split(separator: "\n") where line.hasPrefix("INSTANTIATE_KERNEL(\"") {
                let inner = line.dropFirst("INSTANTIATE_KERNEL(".count).prefix { $0 != ")" }
                let parts = inner.split(separator: ",").map { trim($0, " \"") }
                found[parts[0]] = (parts[1], Array(parts.dropFirst(2)))
            }
        }
        return found
    }

    func testNamesAreUniqueAndIncludeMLXNatives() {
        let names = Self.specs.map(\.name)
        XCTAssertEqual(Set(names).count, names.count, "two specs derive one name")
        for name in ["flash_attn_prefill_bf16_d256", "flash_attn_prefill_f16_d64_boolmask",
                     "flash_attn_prefill_blk_bf16", "flash_attn_vec_dk256", "flash_attn_vec_f16kv_dk512",
                     "flash_attn_vec_reduce_dk512", "flash_attn_vec_reduce_tq_hb_undo_dk256", "sdpa", "sdpa_bf16"] {
            XCTAssertTrue(names.contains(name), name)
        }
    }

    func testEveryInstantiationMatchesTheCapabilityTables() {
        let inst = Self.instantiations
        XCTAssertFalse(inst.isEmpty, "no INSTANTIATE_KERNEL line found")
        for spec in Self.specs + [.simSelftest] {
            guard let got = inst[spec.name] else {
                XCTFail("\(spec.name): in the capability tables but not instantiated in Resources/shaders")
                continue
            }
            XCTAssertEqual(got.function, spec.instantiation.function, spec.name)
            XCTAssertEqual(got.args, spec.instantiation.args, "\(spec.name): template arguments disagree with the table")
        }
        let extra = Set(inst.keys).subtracting(Self.specs.map(\.name)).subtracting(Self.selfTests)
        XCTAssertEqual(extra, [], "instantiated in Resources/shaders but in no capability table")
    }

    func testSimulatorHasEveryKernel() {
        let sim = Set(SimBackend.kernelNames)
        XCTAssertEqual(Set(Self.specs.map(\.name)).subtracting(sim), [], "not compiled into the simulator")
        XCTAssertEqual(Set(EmbeddedShaders.kernelFiles.keys), sim, "sim and embedded sources disagree")
    }

    func testCPUBackendMakesEveryKernel() throws {
        let cpu = CPUBackend()
        for spec in Self.specs {
            // Every constant the kernel family declares, so only a missing kernel can fail.
            let ints = [FunctionConstantIndex.blkBQ: 8, FunctionConstantIndex.blkBK: 8, FunctionConstantIndex.tileLoadBytes: 4]
            let constants = FunctionConstants(FunctionConstantIndex.all.map {
                ($0.index, ints[$0.index].map { .int(Int32($0)) } ?? .bool(false))
            })
            XCTAssertNoThrow(try cpu.makePipeline(PipelineKey(spec: spec, constants: constants)), spec.name)
        }
    }

    /// Function-constant declarations in the shaders use the header's indices.
    func testShaderFunctionConstantsAreTheHeaders() {
        let known = Dictionary(uniqueKeysWithValues: FunctionConstantIndex.all.map { ($0.name, $0.index) })
        let values = Set(known.values)
        var seen = 0
        for (file, text) in EmbeddedShaders.sources {
            for line in text.split(separator: "\n") where line.hasPrefix("FUNCTION_CONSTANT(") {
                let parts = line.dropFirst("FUNCTION_CONSTANT(".count).prefix { $0 != ")" }
                    .split(separator: ",").map { trim($0, " ") }
                let idx = parts[2]
                if idx.hasPrefix("FM_FC_") {
                    XCTAssertNotNil(known[idx], "\(file): \(idx) is not in flashmetal_kernels.h")
                } else if let n = Int(idx), parts[1] != "selftest_scale" {
                    XCTAssertTrue(values.contains(n), "\(file): constant \(parts[1]) at \(n) is not in flashmetal_kernels.h")
                }
                seen += 1
            }
        }
        XCTAssertGreaterThanOrEqual(seen, FunctionConstantIndex.all.count)
    }
}

/// `s` without leading and trailing characters from `chars`.
private func trim(_ s: Substring, _ chars: String) -> String {
    String(s.drop { chars.contains($0) }.reversed().drop { chars.contains($0) }.reversed())
}
