import CFlashMetal

/// The one error type of the library: a C ABI status, the op it concerns,
/// the argument at fault and what is wrong with it. The C ABI hands each
/// field to the caller as it is (FMError of flashmetal.h); nobody parses
/// the message to recover them.
public struct FlashMetalError: Error, CustomStringConvertible, Sendable {
    /// The C status the error maps to.
    public let status: FMStatus
    /// The op that raised it ("" for a backend or internal error); the C
    /// entry point replaces it with the public function its caller names.
    public let op: String
    /// The argument at fault, as the public function spells it ("" when the
    /// error is not about one argument).
    public let argument: String
    /// What is wrong, naming the bad value; without the op.
    public let what: String

    /// An error with a status and a full message (no separate op).
    public init(_ status: FMStatus, _ message: String) {
        self.init(status, op: "", argument: "", what: message)
    }

    /// An error with every field.
    public init(_ status: FMStatus, op: String, argument: String, what: String) {
        self.status = status
        self.op = op
        self.argument = argument
        self.what = what
    }

    /// A bad shape, size, length or option of `arg`.
    public static func value(_ op: String, _ what: String, arg: String = "") -> FlashMetalError {
        FlashMetalError(FM_ERROR_VALUE, op: op, argument: arg, what: what)
    }

    /// A bad dtype of `arg`.
    public static func type(_ op: String, _ what: String, arg: String = "") -> FlashMetalError {
        FlashMetalError(FM_ERROR_TYPE, op: op, argument: arg, what: what)
    }

    /// A feature no kernel implements for this call, about `arg`.
    public static func unsupported(_ op: String, _ what: String, arg: String = "") -> FlashMetalError {
        FlashMetalError(FM_ERROR_UNSUPPORTED, op: op, argument: arg, what: what)
    }

    /// A backend failure (FM_ERROR_BACKEND) of a public op, such as memory
    /// the machine cannot give it.
    public static func backend(_ op: String, _ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_BACKEND, op: op, argument: "", what: what)
    }

    /// A backend could not be created or failed to run a kernel.
    public static func backend(_ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_BACKEND, what)
    }

    /// A bug in the library.
    public static func internalError(_ what: String) -> FlashMetalError {
        FlashMetalError(FM_ERROR_INTERNAL, "internal error: \(what)")
    }

    /// The same error under another op (the public function a caller named).
    public func naming(op newOp: String) -> FlashMetalError {
        FlashMetalError(status, op: newOp, argument: argument, what: what)
    }

    /// "op: what", or `what` alone when no op is set.
    public var message: String { op.isEmpty ? what : "\(op): \(what)" }

    /// The message.
    public var description: String { message }
}
