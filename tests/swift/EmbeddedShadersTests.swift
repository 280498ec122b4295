import FlashMetalShaders
import XCTest

/// The build embeds every shader file, with the shared header inlined and no
/// host-only file, so the Metal compiler gets self-contained sources.
final class EmbeddedShadersTests: XCTestCase {
    func testEverySourceIsSelfContained() {
        for (file, text) in EmbeddedShaders.sources {
            XCTAssertFalse(text.contains("#include \"flashmetal_kernels.h\""), "\(file) still includes the header")
            XCTAssertFalse(text.contains("metal_shim.h\"\n") && !text.contains("__METAL_VERSION__"),
                           "\(file) pulls the host shim outside a host-only branch")
            if text.contains("AttnParams") {
                XCTAssertTrue(text.contains("typedef struct AttnParams"), "\(file) lacks the inlined structs")
            }
        }
    }

    func testKernelTablePointsAtEmbeddedFiles() {
        for (kernel, file) in EmbeddedShaders.kernelFiles {
            let src = Shaders.source(forKernel: kernel)
            XCTAssertEqual(src?.file, file, kernel)
            XCTAssertTrue(src?.text.contains("\"\(kernel)\"") ?? false, kernel)
        }
        XCTAssertNil(Shaders.source(forKernel: "no_such_kernel"))
    }
}
