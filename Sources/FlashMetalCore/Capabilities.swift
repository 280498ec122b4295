import CFlashMetal

/// The capability tables: for each op, the head dims (and their tile
/// geometry), dtypes and variants that have a kernel. Validation, its
/// messages, the kernel enumeration (KernelSpec.all), the head dims the
/// Python package routes by (fm_supported_head_dims) and the shader test all
/// derive from these rows. Adding a head dim is one row here plus one
/// INSTANTIATE_KERNEL line per variant in the shaders.
///
/// The prefill and decode rows are tile widths: any head dim D in
/// 1...maxPaddedHeadDim runs the kernel of the smallest tile Dt >= D with the
/// true D in its params (loads past D read zeros, stores past D are skipped,
/// strides use D); dims above it run only where they have a row of their own.

/// Head dims up to this run on the next tile width up (prefill and decode).
public let maxPaddedHeadDim = 256

/// The tile width of `d` among `tiles` (ascending): the smallest tile >= d
/// for 1 <= d <= maxPaddedHeadDim, d itself above that when it is a tile, else nil.
func tileHeadDim(_ d: Int, tiles: [Int]) -> Int? {
    if d >= 1 && d <= maxPaddedHeadDim { return tiles.first { $0 >= d } }
    return tiles.contains(d) ? d : nil
}

/// The message of a head dim no kernel runs: "head_dim must be in 1...256 or
/// 512, got 300" ("1...256, 512 or 576" where two tiles lie above).
func headDimMessage(_ d: Int, tiles: [Int]) -> String {
    let above = tiles.filter { $0 > maxPaddedHeadDim }
    let extra = above.isEmpty ? "" : (above.count == 1 ? " or " : ", ") + oneOf(above)
    return "head_dim must be in 1...\(maxPaddedHeadDim)\(extra), got \(d)"
}

/// Prefill: head dim → tile geometry.
public enum PrefillCapability {
    /// Head dim → (BQ, BK, WM, WN): the one place the prefill tiles live.
    /// D <= 256 keeps mlx-native's tile (4 simdgroups x 8 query rows, 16 keys):
    /// D/8 whole 8x8 output fragments per simdgroup in registers, and a Q tile
    /// plus a K/V tile of D + 8 padded columns in threadgroup memory,
    /// 48 * (D + 8) * 2 bytes: 8,448 (D=80), 9,984 (96), 19,200 (192), 25,344
    /// (256), all under 32 KiB. D = 512's row is its tile-skip (blk) grid,
    /// 8 x 8; its kernel runs `wideGeometry`.
    public static let geometry: [Int: PrefillGeometry] = [
        64: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        80: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        96: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        128: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        192: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        256: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        512: PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1),
    ]
    /// Float32 kernels' own tiles where the two-byte ones do not fit:
    /// a float32 tile takes a 32-bit word per element, 4 * (BQ + BK) * (D + 8)
    /// bytes: 13,824 (D=64) ... 26,112 (128) at the two-byte geometry;
    /// 32,000 at D = 192 with 8-key tiles. Each tile lies inside one of the
    /// head dim's `geometry` tile, which stays the grid of the tile-skip
    /// classes (blk) and of AttnParams' NQ/NK. D 256 and 512 run
    /// `f32SplitGeometry`.
    public static let f32Geometry: [Int: PrefillGeometry] = [
        64: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        80: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        96: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        128: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        192: PrefillGeometry(bq: 32, bk: 8, wm: 4, wn: 1),
    ]
    /// Float32 kernels that split the head dim between their simdgroups
    /// (`flash_attn_prefill_split`): a float32 tile of 32 query rows would
    /// fill 32 KiB with Q alone at D = 256, so each of WN simdgroups holds
    /// D / WN columns of Q and of O in registers for all BQ rows (32 + 32
    /// floats per thread), reads K and V at those columns straight from
    /// device memory, and the partial scores meet in threadgroup memory:
    /// D = 256 32 rows x 16 keys, 8 simdgroups, 23,296 bytes; D = 512 32 rows
    /// x 8 keys, 16 simdgroups, 26,368 bytes. The D = 256 tile is its blk
    /// tile; the D = 512 one covers four (the kernel combines their classes).
    public static let f32SplitGeometry: [Int: PrefillGeometry] = [
        256: PrefillGeometry(bq: 32, bk: 16, wm: 1, wn: 8),
        512: PrefillGeometry(bq: 32, bk: 8, wm: 1, wn: 16),
    ]
    /// Two-byte kernels whose tile is not their head dim's `geometry` row:
    /// D = 512 shares 16 query rows and 64 keys between 8 simdgroups (each
    /// scores 8 keys, then accumulates 64 of the 512 output columns; the
    /// kernel's header). Each tile covers whole tiles of the `geometry` row,
    /// which stays the grid of the tile-skip classes and of AttnParams'
    /// NQ/NK; the kernel combines the classes of the blk tiles it covers.
    public static let wideGeometry: [Int: PrefillGeometry] = [
        512: PrefillGeometry(bq: 16, bk: 64, wm: 1, wn: 8),
    ]
    /// The head dims with a kernel (tile widths), ascending.
    public static var headDims: [Int] { geometry.keys.sorted() }
    /// The tile width whose kernel runs head dim `d`, or nil when none does.
    public static func tileHeadDim(_ d: Int) -> Int? { FlashMetalCore.tileHeadDim(d, tiles: headDims) }
    /// Q/K/V/out dtypes (an additive mask has the same dtype).
    public static let ioTypes: [DType] = [.bf16, .f16, .f32]

    /// The head dims with a kernel for `io`, ascending.
    public static func headDims(io: DType) -> [Int] {
        io == .f32 ? (Array(f32Geometry.keys) + Array(f32SplitGeometry.keys)).sorted() : headDims
    }

    /// The threadgroup tile of `io`'s kernel at `headDim` (nil: no kernel).
    public static func kernelGeometry(io: DType, headDim: Int) -> PrefillGeometry? {
        io == .f32 ? f32Geometry[headDim] ?? f32SplitGeometry[headDim] : wideGeometry[headDim] ?? geometry[headDim]
    }

    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] {
        ioTypes.flatMap { t in
            headDims(io: t).flatMap { d in [false, true].map { KernelSpec.prefill(io: t, headDim: d, boolMask: $0) } }
        }
    }

    /// The geometry of the kernel that runs `headDim`, or a ValueError naming `op` and the range.
    static func geometry(headDim: Int, op: String) throws -> PrefillGeometry {
        guard let t = tileHeadDim(headDim), let g = geometry[t] else {
            throw FlashMetalError.value(op, headDimMessage(headDim, tiles: headDims), arg: "q")
        }
        return g
    }

    /// The head dim whose tile runs q/k of head dim `headDim` with v (and the
    /// output) of `headDimV`: the larger of the two. Equal dims take any
    /// head dim a kernel runs; unequal ones need both in 1...maxPaddedHeadDim
    /// (the D = 512 body streams V at q's width), else a ValueError naming
    /// `op`, `vName` and both dims.
    static func tileDim(headDim: Int, headDimV: Int, op: String, vName: String) throws -> Int {
        if headDimV == headDim { return headDim }
        guard (1...maxPaddedHeadDim).contains(headDimV), (1...maxPaddedHeadDim).contains(headDim) else {
            throw FlashMetalError.value(
                op, "\(vName) head dim \(headDimV) differs from q's \(headDim): a value head dim of its own needs "
                    + "both in 1...\(maxPaddedHeadDim) on this kernel", arg: vName)
        }
        return max(headDim, headDimV)
    }

    /// The tile-skip geometry for `headDim` of `io`'s kernel, or a ValueError
    /// naming `op` and the head dims `io` has.
    static func geometry(io: DType, headDim: Int, op: String) throws -> PrefillGeometry {
        let dims = headDims(io: io)
        guard FlashMetalCore.tileHeadDim(headDim, tiles: dims) != nil else {
            let what = io == .f32 ? "head_dim of float32 I/O" : "head_dim"
            throw FlashMetalError.value(op, "\(what) \(headDimMessage(headDim, tiles: dims).dropFirst(9))", arg: "q")
        }
        return try geometry(headDim: headDim, op: op)
    }
}

/// The blk pre-pass: any prefill head dim, these mask dtypes.
public enum BlkCapability {
    /// Mask dtypes with a blk kernel (bool: true = 0, false = -inf).
    public static let maskTypes: [DType] = [.bf16, .f16, .f32, .bool]
    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] { maskTypes.map { .blk(mask: $0) } }
}

/// The mask builder: these output dtypes.
public enum MaskBuilderCapability {
    /// Output dtypes with a mask-builder kernel.
    public static let outTypes: [DType] = [.bf16, .f16]
    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] { outTypes.map { .maskBuilder(out: $0) } }
}

/// Split-KV decode.
public enum VecCapability {
    /// Head dims (tile widths) of the decode and the plain reduce kernels. Each lane of the
    /// decode's SIMD group owns dims l, l + 32, ... (the last partial when D
    /// is not a multiple of 32: 80); threadgroup memory pads D to 128. 576 is
    /// MLA's latent-plus-rotary q/k width (its v, the latent, is 512): the
    /// decode of q/k 576 over v 512 runs the 576 tile, its reduce the 512 one.
    public static let headDims = [64, 80, 96, 128, 192, 256, 512, 576]
    /// The tile width whose kernels run head dim `d`, or nil when none does.
    public static func tileHeadDim(_ d: Int) -> Int? { FlashMetalCore.tileHeadDim(d, tiles: headDims) }
    /// Head dims of the FWHT-undo reduce: the Hadamard transform needs a power of two.
    public static var fwhtHeadDims: [Int] { headDims.filter { $0 & ($0 - 1) == 0 } }
    /// K/V cache dtypes; q, tmp and out are float32.
    public static let kvTypes: [DType] = [.f32, .f16, .bf16]
    /// Workgroups each row's keys are split over.
    public static let nwg = Int(FM_VEC_NWG)

    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] {
        kvTypes.flatMap { t in headDims.map { KernelSpec.vec(kv: t, headDim: $0) } }
            + headDims.map { KernelSpec.vecReduce(headDim: $0, fwht: false) }
            + fwhtHeadDims.map { KernelSpec.vecReduce(headDim: $0, fwht: true) }
    }

    /// The tile width that runs q/k of head dim `d` with v (and the output)
    /// of head dim `dv`: the tile of the larger (any dims up to
    /// maxPaddedHeadDim, else the larger must be a tile of its own; the
    /// kernel reads each side only up to its own dim), or a ValueError naming
    /// `op`, `vName` and the dims.
    @discardableResult
    static func tileDim(_ d: Int, dv: Int, op: String, vName: String) throws -> Int {
        try requireHeadDim(d, op: op)
        if dv == d { return d }
        guard dv >= 1, let t = tileHeadDim(max(d, dv)) else {
            throw FlashMetalError.value(
                op, "\(vName) head dim \(dv) with q's \(d): the decode runs a value head dim of its own up to the "
                    + "larger's tile, " + headDimMessage(max(d, dv), tiles: headDims), arg: vName)
        }
        return t
    }

    /// The tile width that runs `d`, or a ValueError naming `op` and the range
    /// (with `fwht`, one of fwhtHeadDims).
    @discardableResult
    static func requireHeadDim(_ d: Int, fwht: Bool = false, op: String) throws -> Int {
        guard let t = tileHeadDim(d) else {
            throw FlashMetalError.value(op, headDimMessage(d, tiles: headDims), arg: "q")
        }
        if fwht && !fwhtHeadDims.contains(d) {
            throw FlashMetalError.value(op, "the FWHT undo needs a power-of-two head_dim (\(oneOf(fwhtHeadDims))), got \(d)", arg: "fwht")
        }
        return t
    }
}

/// Simple SDPA: any head dim up to `maxHeadDim`.
public enum SdpaCapability {
    /// Q/K/V/out dtypes with an sdpa kernel.
    public static let ioTypes: [DType] = [.f32, .f16, .bf16]
    /// The largest head dim the kernel handles (its per-thread accumulators).
    /// Any practical head dim: the Metal kernel walks the output in 64-column
    /// blocks (recomputing the scores per block) and the cpu kernel keeps 4*D
    /// floats per worker, so D costs time, not registers; the bound only keeps
    /// D*length products far from overflow.
    public static let maxHeadDim = 65536
    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] { ioTypes.map { .sdpa(io: $0) } }
}

/// rotary: rotary embedding of rows of any head dim, x and the cos/sin tables
/// each in any of these dtypes.
public enum RotaryCapability {
    /// Dtypes of x (and out) and, separately, of the cos/sin tables.
    public static let types: [DType] = [.f32, .f16, .bf16]
    /// Threads per threadgroup; loops cover the pairs and dims past them.
    public static let threads = 64
    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] { types.flatMap { x in types.map { .rotary(x: x, tables: $0) } } }
}

/// kv_append: copies rows of any head dim into caches of these dtypes (the
/// decode caches' and the prefill caches' dtypes).
public enum KVAppendCapability {
    /// Cache (and k_new/v_new) dtypes with a kv_append kernel.
    public static let cacheTypes: [DType] = [.f32, .f16, .bf16]
    /// Threads per threadgroup; a loop covers the head dims past it.
    public static let threads = 128
    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] { cacheTypes.map { .kvAppend(cache: $0) } }
}

/// "64, 128, 256 or 512".
func oneOf(_ values: [Int]) -> String {
    let s = values.map(String.init)
    return s.count <= 1 ? s.joined() : s.dropLast().joined(separator: ", ") + " or " + s.last!
}
