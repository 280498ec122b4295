import CFlashMetal
import FlashMetalCore
import FlashMetalShaders
import XCTest

/// The Swift enums that mirror C enums of flashmetal.h and flashmetal_kernels.h carry the same values,
/// and the numeric constants are what the numeric contract (docs/ARCHITECTURE.md) says.
final class HeaderConstantsTests: XCTestCase {
    func testDTypeIsFMDType() {
        let c: [(DType, FMDType)] = [(.f32, FM_DTYPE_F32), (.f16, FM_DTYPE_F16), (.bf16, FM_DTYPE_BF16),
                                     (.bool, FM_DTYPE_BOOL), (.u8, FM_DTYPE_U8), (.i32, FM_DTYPE_I32)]
        XCTAssertEqual(c.count, DType.allCases.count)
        for (s, v) in c { XCTAssertEqual(UInt32(s.rawValue), v.rawValue, "\(s)") }
    }

    func testLayoutIsFMLayout() {
        XCTAssertEqual(UInt32(PrefillLayout.headMajor.rawValue), FM_LAYOUT_BHLD.rawValue)
        XCTAssertEqual(UInt32(PrefillLayout.seqMajor.rawValue), FM_LAYOUT_BLHD.rawValue)
        XCTAssertEqual(PrefillLayout.allCases.count, 2)
    }

    func testMaskKindsAreFMMaskKind() {
        let c: [(MaskKind, FMMaskKind)] = [(.none, FM_MASK_NONE), (.additive, FM_MASK_ADDITIVE), (.bool, FM_MASK_BOOL)]
        XCTAssertEqual(c.count, MaskKind.allCases.count)
        for (s, v) in c { XCTAssertEqual(UInt32(s.rawValue), v.rawValue, "\(s)") }
    }

    func testVecMaskTypesAreFMVecMaskType() {
        let c: [(VecMaskType, FMVecMaskType)] = [(.none, FM_VEC_MASK_NONE), (.causal, FM_VEC_MASK_CAUSAL),
                                                 (.window, FM_VEC_MASK_WINDOW)]
        XCTAssertEqual(c.count, VecMaskType.allCases.count)
        for (s, v) in c { XCTAssertEqual(UInt32(s.rawValue), v.rawValue, "\(s)") }
    }

    func testStatusCodesAreDistinct() {
        let codes = [FM_OK, FM_ERROR_VALUE, FM_ERROR_TYPE, FM_ERROR_BACKEND, FM_ERROR_INTERNAL].map(\.rawValue)
        XCTAssertEqual(Set(codes).count, codes.count)
        XCTAssertEqual(FM_OK.rawValue, 0)
    }

    func testFunctionConstantIndicesAreMLXNatives() {
        // mlx-native's kernels fix these indices; the others must not collide with them.
        XCTAssertEqual(FunctionConstantIndex.alignQ, 200)
        XCTAssertEqual(FunctionConstantIndex.alignK, 201)
        XCTAssertEqual(FunctionConstantIndex.hasMask, 300)
        XCTAssertEqual(FunctionConstantIndex.doCausal, 301)
        XCTAssertEqual(FunctionConstantIndex.hasBlk, 303)
        XCTAssertEqual(FunctionConstantIndex.blkBQ, 400)
        XCTAssertEqual(FunctionConstantIndex.blkBK, 401)
        let all = FunctionConstantIndex.all.map(\.index)
        XCTAssertEqual(Set(all).count, all.count)
    }

    func testNumericConstants() {
        XCTAssertEqual(FM_RUNNING_MAX_START, -Float.greatestFiniteMagnitude / 2)
        XCTAssertEqual(FM_LOG2E, Float(1.4426950408889634))
        XCTAssertEqual(VecCapability.nwg, 32)
    }

    func testBindingsAreDistinctPerKernel() {
        let sets: [[Int]] = [
            [PrefillBuffer.q, PrefillBuffer.k, PrefillBuffer.v, PrefillBuffer.out, PrefillBuffer.params,
             PrefillBuffer.maskParams, PrefillBuffer.mask, PrefillBuffer.blk],
            [BlkBuffer.mask, BlkBuffer.out, BlkBuffer.params],
            [MaskBuilderBuffer.out, MaskBuilderBuffer.params],
            [VecBuffer.params, VecBuffer.q, VecBuffer.k, VecBuffer.v, VecBuffer.tmp],
            [VecReduceBuffer.params, VecReduceBuffer.tmp, VecReduceBuffer.out, VecReduceBuffer.nwg, VecReduceBuffer.signs],
            [SdpaBuffer.q, SdpaBuffer.k, SdpaBuffer.v, SdpaBuffer.out, SdpaBuffer.params, SdpaBuffer.maskParams,
             SdpaBuffer.additiveMask, SdpaBuffer.boolMask],
        ]
        for s in sets { XCTAssertEqual(Set(s).count, s.count, "\(s)") }
        // mlx-native's prefill bindings.
        XCTAssertEqual([PrefillBuffer.q, PrefillBuffer.k, PrefillBuffer.v, PrefillBuffer.out, PrefillBuffer.params,
                        PrefillBuffer.maskParams, PrefillBuffer.mask, PrefillBuffer.blk], Array(0...7))
    }

    func testABIVersion() {
        XCTAssertGreaterThanOrEqual(Int(FM_ABI_VERSION), 1)
        XCTAssertFalse(FM_VERSION.isEmpty)
    }

    /// Shaders that still spell the running-max start or log2(e) as a literal
    /// (instead of FM_RUNNING_MAX_START / FM_LOG2E) must spell the header's value.
    func testShaderNumericLiteralsAreTheHeaders() {
        var checked = 0
        for (file, text) in EmbeddedShaders.sources {
            for line in text.split(separator: "\n") where line.hasPrefix("#define ") {
                let parts = line.split(separator: " ", maxSplits: 2)
                guard parts.count == 3 else { continue }
                let literal = parts[2].filter { !"()f".contains($0) }
                guard let value = Float(literal) else { continue }
                if parts[1] == "SDPA_TILE_Q" {
                    XCTAssertEqual(Int(value), SdpaDispatcher.tileQ, "\(file): the dispatch's rows per threadgroup")
                    checked += 1
                } else if parts[1].hasSuffix("ROW_MAX_INIT") {
                    XCTAssertEqual(value, FM_RUNNING_MAX_START, "\(file): \(parts[1])")
                    checked += 1
                } else if parts[1].hasSuffix("LOG2E") {
                    XCTAssertEqual(value, FM_LOG2E, "\(file): \(parts[1])")
                    checked += 1
                }
            }
        }
        _ = checked  // zero once every shader uses the header's names
    }
}
