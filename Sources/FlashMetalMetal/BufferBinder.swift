#if canImport(Metal)
import FlashMetalCore
import Metal

/// Wraps caller memory in MTLBuffers without copying: the page-aligned
/// region around the tensor is bound (bytesNoCopy) and the tensor is reached
/// through the buffer offset. Where Metal refuses (e.g. the rounded region
/// leaves the allocation), the tensor is copied in and copied back after the
/// command buffer completes.
struct BufferBinder {
    struct Copy {
        let buffer: MTLBuffer
        let tensor: TensorRef
        func copyBack() {
            tensor.data.copyMemory(from: buffer.contents(), byteCount: tensor.byteCount)
        }
    }

    let device: MTLDevice
    private(set) var copies: [Copy] = []

    init(device: MTLDevice) { self.device = device }

    mutating func bind(_ t: TensorRef) throws -> (MTLBuffer, Int) {
        let page = Int(getpagesize())
        let address = UInt(bitPattern: t.data)
        let base = address & ~UInt(page - 1)
        let offset = Int(address - base)
        let length = (offset + max(t.byteCount, 1) + page - 1) & ~(page - 1)
        if let raw = UnsafeMutableRawPointer(bitPattern: base),
           let buf = device.makeBuffer(bytesNoCopy: raw, length: length, options: .storageModeShared,
                                       deallocator: nil) {
            return (buf, offset)
        }
        guard let buf = device.makeBuffer(bytes: t.data, length: max(t.byteCount, 1), options: .storageModeShared)
        else {
            throw FlashMetalError.backend("metal backend: cannot allocate a \(t.byteCount)-byte buffer")
        }
        copies.append(Copy(buffer: buf, tensor: t))
        return (buf, 0)
    }
}
#endif
