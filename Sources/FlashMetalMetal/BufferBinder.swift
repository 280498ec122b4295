#if canImport(Metal)
import FlashMetalCore
#if canImport(Darwin)
import Darwin  // on Linux, the metal-sim Metal module brings in glibc
#endif
import Metal

/// Wraps caller memory in MTLBuffers for one command buffer. Every distinct
/// tensor (data pointer + byte range) gets one MTLBuffer, however many
/// dispatches or bindings use it: the page-aligned region around the tensor
/// is bound without a copy (bytesNoCopy) and the tensor is reached through
/// the buffer offset. Where Metal refuses (Apple documents bytesNoCopy for
/// VM-allocated memory only), the tensor is copied in once and, if some
/// kernel writes it, copied back once after the command buffer completes;
/// inputs are never written back (the caller's memory may be read-only).
final class BufferBinder {
    private struct Entry {
        let start: UInt, end: UInt
        let buffer: MTLBuffer
        /// Offset of `start` inside `buffer`.
        let offset: Int
        /// Caller memory this entry copied in (nil: bound without a copy).
        let copiedFrom: UnsafeMutableRawPointer?
        var written = false
    }

    let device: MTLDevice
    private var entries: [Entry] = []
    /// The long-lived buffer (and its base address) that wraps a whole
    /// fm_alloc_host allocation holding [start, end), if one does.
    private let persistent: (UInt, UInt) -> (buffer: MTLBuffer, base: UInt)?

    init(device: MTLDevice, persistent: @escaping (UInt, UInt) -> (buffer: MTLBuffer, base: UInt)?) {
        self.device = device
        self.persistent = persistent
    }

    /// The buffer and offset at which kernels see `t`. Throws when Metal
    /// cannot allocate, or when `t` partly overlaps a tensor that had to be
    /// copied (two copies of one memory would diverge).
    func bind(_ t: TensorRef) throws -> (buffer: MTLBuffer, offset: Int) {
        let start = UInt(bitPattern: t.data)
        let end = start + UInt(max(t.byteCount, 1))
        if let e = entries.first(where: { $0.start <= start && end <= $0.end }) {
            return (e.buffer, e.offset + Int(start - e.start))
        }
        if entries.contains(where: { $0.copiedFrom != nil && $0.start < end && start < $0.end }) {
            throw FlashMetalError.backend(
                "metal backend: a \(t.byteCount)-byte tensor at \(t.data) partly overlaps another tensor that Metal could not bind without a copy")
        }
        if let p = persistent(start, end) {
            entries.append(Entry(start: p.base, end: p.base + UInt(p.buffer.length), buffer: p.buffer, offset: 0,
                                 copiedFrom: nil))
            return (p.buffer, Int(start - p.base))
        }
        let page = UInt(getpagesize())
        let base = start & ~(page - 1)
        let length = Int((end - base + page - 1) & ~(page - 1))
        if let raw = UnsafeMutableRawPointer(bitPattern: base),
           let buf = device.makeBuffer(bytesNoCopy: raw, length: length, options: .storageModeShared,
                                       deallocator: nil) {
            entries.append(Entry(start: base, end: base + UInt(length), buffer: buf, offset: 0, copiedFrom: nil))
            return (buf, Int(start - base))
        }
        // The copy keeps the tensor's offset within its 64-byte block (the
        // bytes before it in that block come along, never written back): a
        // kernel sees every address inside it with the alignment the host
        // saw, which the dispatchers' vector-load choices rely on. The block
        // lies in the tensor's first page, so reading it cannot fault.
        let lead = Int(start % 64)
        guard let buf = device.makeBuffer(bytes: t.data - lead, length: Int(end - start) + lead,
                                          options: .storageModeShared)
        else {
            throw FlashMetalError.backend("metal backend: cannot allocate a \(t.byteCount)-byte buffer")
        }
        entries.append(Entry(start: start, end: end, buffer: buf, offset: lead, copiedFrom: t.data))
        return (buf, lead)
    }

    /// Notes that a kernel writes `t` (already bound): its copy, if any, is
    /// copied back by `copyBack()`.
    func markWritten(_ t: TensorRef) {
        let start = UInt(bitPattern: t.data)
        if let i = entries.firstIndex(where: { $0.start <= start && start < $0.end }) {
            entries[i].written = true
        }
    }

    /// After the command buffer completed: copies written copies back.
    func copyBack() {
        for e in entries where e.written {
            guard let dst = e.copiedFrom else { continue }
            dst.copyMemory(from: e.buffer.contents() + e.offset, byteCount: Int(e.end - e.start))
        }
    }
}
#endif
