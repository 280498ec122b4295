import Foundation
import PackagePlugin

/// Turns Resources/shaders/*.metal into a Swift file of raw string literals
/// (with the shared header inlined) so the library carries its shaders and
/// never looks them up at run time.
@main
struct EmbedShaders: BuildToolPlugin {
    func createBuildCommands(context: PluginContext, target: Target) throws -> [Command] {
        let root = context.package.directoryURL
        let shaders = root.appendingPathComponent("Resources/shaders")
        let header = root.appendingPathComponent("Sources/CFlashMetal/include/flashmetal_kernels.h")
        let files = ((try? FileManager.default.contentsOfDirectory(atPath: shaders.path)) ?? [])
            .filter { $0.hasSuffix(".metal") || $0.hasSuffix(".h") }
            .sorted()
            .map { shaders.appendingPathComponent($0) }
        let output = context.pluginWorkDirectoryURL.appendingPathComponent("EmbeddedShaders.swift")
        return [.buildCommand(
            displayName: "Embedding \(files.count) shader files",
            executable: try context.tool(named: "ShaderEmbedder").url,
            arguments: [output.path, header.path] + files.map(\.path),
            inputFiles: [header] + files,
            outputFiles: [output])]
    }
}
