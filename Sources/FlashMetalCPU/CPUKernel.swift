import FlashMetalCore

/// A cpu pipeline: a native kernel specialised by its function constants.
protocol CPUKernel: AnyObject {
    func run(_ d: Dispatch, pool: WorkerPool) throws
}

extension FunctionConstants {
    /// A bool constant the kernel declares; unset is an error, as on Metal.
    func requireBool(_ index: Int, kernel: String) throws -> Bool {
        guard let b = bool(index) else {
            throw FlashMetalError.backend("cpu backend: \(kernel): function constant \(index) (bool) is not set")
        }
        return b
    }

    func requireInt(_ index: Int, kernel: String) throws -> Int32 {
        guard let i = int(index) else {
            throw FlashMetalError.backend("cpu backend: \(kernel): function constant \(index) (int) is not set")
        }
        return i
    }
}
