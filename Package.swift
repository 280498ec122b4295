// swift-tools-version:6.0
import PackageDescription

// The library exports its C ABI (fm_*) and nothing else: not the Swift
// modules' public symbols, not the simulator's C++ internals.
let packageRoot = String(#filePath.dropLast("/Package.swift".count))
let exportOnlyCABI: [LinkerSetting] = [
    .unsafeFlags(["-Xlinker", "--version-script=\(packageRoot)/Sources/FlashMetal/exports.map"],
                 .when(platforms: [.linux])),
    // Never unmapped by dlclose (cffi closes the library when its handle is
    // collected at interpreter exit): the process-wide pool's workers may
    // still be running library code then. macOS never unloads a dylib that
    // carries Swift metadata.
    .unsafeFlags(["-Xlinker", "-z", "-Xlinker", "nodelete"], .when(platforms: [.linux])),
    .unsafeFlags(["-Xlinker", "-exported_symbol", "-Xlinker", "_fm_*"], .when(platforms: [.macOS])),
]

// Linux only: the metal-sim runtime, a module named Metal that implements
// the Metal API the backend uses and runs its dispatches on the simulator,
// so the Metal backend's sources build and run as the "metal-sim" backend.
// On macOS the SDK's Metal is used.
#if os(Linux)
let metalRuntime: [Target] = [
    .target(name: "Metal", dependencies: ["FlashMetalSim", "FlashMetalSimDispatch"], path: "Sources/MetalSim/Metal"),
]
let metalRuntimeDeps: [Target.Dependency] = ["Metal"]
#else
let metalRuntime: [Target] = []
let metalRuntimeDeps: [Target.Dependency] = []
#endif

// One dynamic library (libflashmetal) with a plain C ABI. Targets are split so
// that each backend depends only on the portable core.
let package = Package(
    name: "flashmetal",
    // macOS 14 is the floor because the kernels use `bfloat`, which needs
    // MSL 3.1 (MTLLanguageVersion.version3_1, macOS 14+). An older target
    // would have to guard the whole Metal backend with #available and still
    // fail on the bf16 kernels, so the package says so up front. Checked on
    // Linux by `make mac-check` (mk/mac.mk reads the version from here).
    platforms: [.macOS(.v14)],
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
        // Build-time tool and plugin that embed Resources/shaders in the library.
        .executableTarget(name: "ShaderEmbedder", path: "Sources/ShaderEmbedder"),
        .plugin(name: "EmbedShaders", capability: .buildTool(), dependencies: ["ShaderEmbedder"],
                path: "Plugins/EmbedShaders"),
        .target(name: "FlashMetalShaders", path: "Sources/FlashMetalShaders",
                plugins: ["EmbedShaders"]),
        // The Metal backend; compiles to nothing where Metal is unavailable.
        .target(name: "FlashMetalMetal", dependencies: ["FlashMetalCore", "FlashMetalShaders"] + metalRuntimeDeps,
                path: "Sources/FlashMetalMetal"),
        // The GPU simulator (C++20): the shaders of Resources/shaders compiled
        // for the host and run as fibers (docs/SIMULATOR.md).
        .target(name: "FlashMetalSim", path: "Sources/FlashMetalSim",
                // flashmetal_kernels.h is read textually (the shaders include it), not as a module.
                cxxSettings: [.headerSearchPath("../CFlashMetal/include"),
                              .unsafeFlags(["-Xclang", "-ffloat16-excess-precision=none",
                                            "-Wno-unknown-attributes", "-Werror=double-promotion", "-O2",
                                            "-fvisibility=hidden"])],
                linkerSettings: [.linkedLibrary("stdc++", .when(platforms: [.linux]))]),
        // The same shaders once more, every load and store traced
        // (FlashMetalSim/counters.h): run only by dispatches that ask for
        // counts (the GPU cost model), never by the others.
        .target(name: "FlashMetalSimCounted", dependencies: ["FlashMetalSim"],
                path: "Sources/FlashMetalSimCounted",
                cxxSettings: [.headerSearchPath("../CFlashMetal/include"),
                              .unsafeFlags(["-Xclang", "-ffloat16-excess-precision=none",
                                            "-Wno-unknown-attributes", "-Werror=double-promotion", "-O2",
                                            "-fvisibility=hidden",
                                            "-fsanitize-coverage=edge,trace-loads,trace-stores",
                                            "-fno-vectorize", "-fno-slp-vectorize",
                                            // A vector load stays one access (the pass would split
                                            // one whose lanes are only extracted into scalar loads).
                                            "-mllvm", "-disable-vector-combine"])]),
        // One simulator dispatch from Swift values (the sim backend's and metal-sim's).
        .target(name: "FlashMetalSimDispatch", dependencies: ["FlashMetalSim"],
                path: "Sources/FlashMetalSimDispatch"),
        // The "sim" backend: Dispatch values → the simulator.
        .target(name: "FlashMetalSimBackend", dependencies: ["FlashMetalCore", "FlashMetalSim", "FlashMetalSimDispatch",
                                                         "FlashMetalSimCounted", "FlashMetalCPUKernels"],
                path: "Sources/FlashMetalSimBackend"),
        // The @_cdecl entry points that make up libflashmetal.
        .target(name: "FlashMetal", dependencies: ["FlashMetalCore", "FlashMetalCPU", "FlashMetalMetal",
                                               "FlashMetalSimBackend"],
                path: "Sources/FlashMetal", exclude: ["exports.map"], linkerSettings: exportOnlyCABI),
        .testTarget(name: "FlashMetalTests",
                    dependencies: ["FlashMetalCore", "FlashMetalCPU", "FlashMetalShaders", "CFlashMetal",
                                   "FlashMetalSimBackend", "FlashMetalMetal"] + metalRuntimeDeps,
                    path: "tests/swift"),
    ] + metalRuntime,
    swiftLanguageModes: [.v5],
    cLanguageStandard: .c11,
    cxxLanguageStandard: .cxx20
)
