// swift-tools-version:6.0
import PackageDescription

// One dynamic library (libflashmetal) with a plain C ABI. Targets are split so
// that each backend depends only on the portable core.
let package = Package(
    name: "flashmetal",
    products: [
        .library(name: "flashmetal", type: .dynamic, targets: ["FlashMetal"]),
    ],
    targets: [
        // The C ABI and the kernel parameter structs: one definition for
        // Swift, C, C++ and MSL.
        .target(name: "CFlashMetal", path: "Sources/CFlashMetal"),
        // Dtypes, tensors, dispatchers, the registry and the Backend protocol.
        .target(name: "FlashMetalCore", dependencies: ["CFlashMetal"],
                path: "Sources/FlashMetalCore"),
        // Hot loops of the cpu backend, in C for the auto-vectoriser.
        .target(name: "FlashMetalCPUKernels", dependencies: ["CFlashMetal"],
                path: "Sources/FlashMetalCPUKernels",
                cSettings: [.unsafeFlags(["-O3", "-ffp-contract=off"])]),
        // The cpu backend: kernel names and constants → native kernels.
        .target(name: "FlashMetalCPU", dependencies: ["FlashMetalCore", "FlashMetalCPUKernels"],
                path: "Sources/FlashMetalCPU"),
        // The @_cdecl entry points that make up libflashmetal.
        .target(name: "FlashMetal", dependencies: ["FlashMetalCore", "FlashMetalCPU"],
                path: "Sources/FlashMetal"),
        .testTarget(name: "FlashMetalTests",
                    dependencies: ["FlashMetalCore", "FlashMetalCPU", "CFlashMetal"],
                    path: "tests/swift"),
    ],
    swiftLanguageModes: [.v5],
    cLanguageStandard: .c11,
    cxxLanguageStandard: .cxx20
)
