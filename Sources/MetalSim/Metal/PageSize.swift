// Apple's Metal module brings in Foundation and with it Darwin; this one
// brings in glibc, with getpagesize() answering Apple silicon's 16 KiB VM
// page (it shadows glibc's for code that imports Metal), so host code
// written for macOS sizes its no-copy buffers as it does on a Mac.
// https://developer.apple.com/documentation/apple-silicon/addressing-architectural-differences-in-your-macos-code
// ("Apple silicon uses 16 KB memory pages").
@_exported import Glibc

/// Apple silicon's VM page size in bytes.
public func getpagesize() -> Int32 { Int32(pageSize) }
