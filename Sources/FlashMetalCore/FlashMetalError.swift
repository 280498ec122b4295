import CFlashMetal

/// The one error type of the library: a C ABI status plus a message that
/// names the op and the bad value. Nothing else crosses the C boundary.
public struct FlashMetalError: Error, CustomStringConvertible, Sendable {
    /// The C status the error maps to.
    public let status: FMStatus
    /// "op: what", naming the op and the bad value.
    public let message: String

    /// An error with a status and a message that names the op.
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

    /// A backend could not be created or failed to run a kernel.
    public static func backend(_ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_BACKEND, what)
    }

    /// A bug in the library.
    public static func internalError(_ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_INTERNAL, "internal error: \(what)")
    }

    /// The message.
    public var description: String { message }
}
