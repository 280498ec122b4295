import CFlashMetal

/// The one error type of the library: a C ABI status plus a message that
/// names the op and the bad value. Nothing else crosses the C boundary.
public struct FlashMetalError: Error, CustomStringConvertible, Sendable {
    public let status: FMStatus
    public let message: String

    public init(_ status: FMStatus, _ message: String) {
        self.status = status
        self.message = message
    }

    /// A bad shape, size, length or option.
    public static func value(_ op: String, _ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_VALUE, "\(op): \(what)")
    }

    /// A bad dtype.
    public static func type(_ op: String, _ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_TYPE, "\(op): \(what)")
    }

    public static func backend(_ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_BACKEND, what)
    }

    public static func internalError(_ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_INTERNAL, "internal error: \(what)")
    }

    public var description: String { message }
}
