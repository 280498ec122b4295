/// The Metal sources of every kernel, embedded at build time by the
/// EmbedShaders plugin (see EmbeddedShaders, generated).
public enum Shaders {
    /// The source file that defines `kernel`, or nil.
    public static func source(forKernel kernel: String) -> (file: String, text: String)? {
        guard let file = EmbeddedShaders.kernelFiles[kernel], let text = EmbeddedShaders.sources[file] else {
            return nil
        }
        return (file, text)
    }
}
