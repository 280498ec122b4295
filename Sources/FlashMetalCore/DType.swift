import CFlashMetal

/// Element type of a borrowed tensor; raw values are the C ABI's FMDType.
public enum DType: Int32, CaseIterable, Sendable {
    case f32 = 0, f16 = 1, bf16 = 2, bool = 3, u8 = 4, i32 = 5

    /// Bytes per element.
    public var byteSize: Int {
        switch self {
        case .f32, .i32: return 4
        case .f16, .bf16: return 2
        case .bool, .u8: return 1
        }
    }

    /// The name users see in messages (numpy's spelling).
    public var name: String {
        switch self {
        case .f32: return "float32"
        case .f16: return "float16"
        case .bf16: return "bfloat16"
        case .bool: return "bool"
        case .u8: return "uint8"
        case .i32: return "int32"
        }
    }
}
