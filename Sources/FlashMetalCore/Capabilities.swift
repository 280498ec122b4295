import CFlashMetal

/// The capability tables: for each op, the head dims (and their tile
/// geometry), dtypes and variants that have a kernel. Validation, its
/// messages, the kernel enumeration (KernelSpec.all), the head dims the
/// Python package routes by (fm_supported_head_dims) and the shader test all
/// derive from these rows, and so do the shaders' INSTANTIATE_KERNEL lines
/// (tools/gen_instantiations.py writes them from fm_kernel_instantiations):
/// adding a head dim is one row here, then `make kernel-instantiations`.
///
/// The prefill and decode rows are tile widths: any head dim D in
/// 1...maxPaddedHeadDim runs the kernel of the smallest tile Dt >= D with the
/// true D in its params (loads past D read zeros, stores past D are skipped,
/// strides use D); dims above it run only where they have a row of their own.

/// Head dims up to this run on the next tile width up (prefill and decode).
public let maxPaddedHeadDim = 512

/// The tile width of `d` among `tiles` (ascending): the smallest tile >= d
/// for 1 <= d <= maxPaddedHeadDim, d itself above that when it is a tile, else nil.
func tileHeadDim(_ d: Int, tiles: [Int]) -> Int? {
    if d >= 1 && d <= maxPaddedHeadDim { return tiles.first { $0 >= d } }
    return tiles.contains(d) ? d : nil
}

/// The message of a head dim no kernel runs: "head_dim must be in 1...512,
/// got 600" ("1...512 or 576" where a tile lies above).
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
    /// (256), all under 32 KiB. D = 512's and 576's rows are their tile-skip
    /// (blk) grid, 8 x 8; their kernels run `wideGeometry`.
    public static let geometry: [Int: PrefillGeometry] = [
        64: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        80: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        96: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        128: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        192: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        256: PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1),
        512: PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1),
        576: PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1),
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
    /// kernel's header); D = 576 the same over q/k of 576 columns and v of
    /// 512 (`valueHeadDim`). Each tile covers whole tiles of the `geometry` row,
    /// which stays the grid of the tile-skip classes and of AttnParams'
    /// NQ/NK; the kernel combines the classes of the blk tiles it covers.
    public static let wideGeometry: [Int: PrefillGeometry] = [
        512: PrefillGeometry(bq: 16, bk: 64, wm: 1, wn: 8),
        576: PrefillGeometry(bq: 16, bk: 64, wm: 1, wn: 8),
    ]
    /// Tile widths whose two-byte kernel runs q/k of that head dim only with
    /// v (and the output) of one narrower head dim of its own: MLA's q/k 576
    /// (a 512-wide latent plus 64 rotary dims) over its 512-wide latent v.
    /// The kernel's Q^T and K reads span the tile width, its V reads and O
    /// columns the v dim (the wide body's BDV).
    public static let valueHeadDim: [Int: Int] = [576: 512]
    /// The head dims with a kernel for q/k and v of one head dim (tile widths), ascending.
    public static var headDims: [Int] { geometry.keys.filter { valueHeadDim[$0] == nil }.sorted() }
    /// The tile width whose kernel runs head dim `d` (q/k's, or the larger
    /// of q/k's and v's), or nil when none does; a `valueHeadDim` tile is
    /// its own (it runs only with its v dim: `tileDim`).
    public static func tileHeadDim(_ d: Int) -> Int? {
        FlashMetalCore.tileHeadDim(d, tiles: headDims) ?? (valueHeadDim[d] != nil ? d : nil)
    }
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

    /// The head dims with a kernel for `io`, `valueHeadDim`'s tiles
    /// included (two-byte I/O only), ascending.
    static func kernelHeadDims(io: DType) -> [Int] {
        io == .f32 ? headDims(io: io) : (headDims(io: io) + valueHeadDim.keys).sorted()
    }

    /// Every kernel of the op, enumerated from the table.
    public static var kernels: [KernelSpec] {
        ioTypes.flatMap { t in
            kernelHeadDims(io: t).flatMap { d in [false, true].map { KernelSpec.prefill(io: t, headDim: d, boolMask: $0) } }
        }
    }

    /// The geometry of the kernel that runs `headDim` (any tile width,
    /// `valueHeadDim`'s included: the blk grid), or a ValueError naming `op` and the range.
    static func geometry(headDim: Int, op: String) throws -> PrefillGeometry {
        guard let t = tileHeadDim(headDim), let g = geometry[t] else {
            throw FlashMetalError.value(op, headDimMessage(headDim, tiles: geometry.keys.sorted()), arg: "q")
        }
        return g
    }

    /// The head dim whose tile runs q/k of head dim `headDim` with v (and the
    /// output) of `headDimV`: the larger of the two, or a `valueHeadDim`
    /// tile with its own v dim (576 over 512). Equal dims take any head dim
    /// `headDims` has; unequal ones need both in 1...maxPaddedHeadDim (each
    /// side read up to its own dim) or a `valueHeadDim` pair, else
    /// a ValueError naming `op`, `vName` and both dims.
    static func tileDim(headDim: Int, headDimV: Int, op: String, vName: String) throws -> Int {
        if let dv = valueHeadDim[headDim] {
            if headDimV == dv { return headDim }
            if headDimV == headDim {
                throw FlashMetalError.value(
                    op, headDimMessage(headDim, tiles: headDims) + " (q/k of \(headDim) run only with a \(vName) "
                        + "head dim of \(dv))", arg: "q")
            }
        }
        if headDimV == headDim { return headDim }
        guard (1...maxPaddedHeadDim).contains(headDimV), (1...maxPaddedHeadDim).contains(headDim) else {
            let pairs = valueHeadDim.sorted { $0.key < $1.key }.map { "q/k \($0.key) with \($0.value)" }
            throw FlashMetalError.value(
                op, "\(vName) head dim \(headDimV) differs from q's \(headDim): a value head dim of its own needs "
                    + "both in 1...\(maxPaddedHeadDim) on this kernel, or " + pairs.joined(separator: ", "), arg: vName)
        }
        return max(headDim, headDimV)
    }

    /// Whether `io`'s kernels run q/k of head dim `d` with v (and the output)
    /// of `dv`: what the dispatchers validate (tileDim, then geometry).
    public static func runs(io: DType, headDim d: Int, headDimV dv: Int) -> Bool {
        (try? geometry(io: io, headDim: tileDim(headDim: d, headDimV: dv, op: "", vName: "v"), op: "")) != nil
    }

    /// The tile-skip geometry for `headDim` (a tile width from `tileDim`) of
    /// `io`'s kernel, or a ValueError naming `op` and the head dims `io` has
    /// (a `valueHeadDim` tile: two-byte I/O only).
    static func geometry(io: DType, headDim: Int, op: String) throws -> PrefillGeometry {
        if let dv = valueHeadDim[headDim], let g = geometry[headDim] {
            guard io != .f32 else {
                throw FlashMetalError.value(
                    op, "q/k head dim \(headDim) with v head dim \(dv) runs on bfloat16 and float16 only (no float32 "
                        + "kernel of that width), got float32", arg: "q")
            }
            return g
        }
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
    /// The most query rows (SIMD groups) one decode threadgroup serves at tile
    /// width `headDim` (the kernel's vec_group_rows): 32 (1024 threads) up to
    /// 128, 16 up to 256, 8 beyond, as a lane's registers grow with D.
    public static func groupRows(headDim: Int) -> Int {
        Int(headDim <= 128 ? FM_VEC_GROUP_ROWS_D128 : headDim <= 256 ? FM_VEC_GROUP_ROWS_D256 : FM_VEC_GROUP_ROWS_WIDE)
    }

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

    /// Whether the decode runs q/k of head dim `d` with v (and the output) of `dv` (tileDim).
    public static func runs(headDim d: Int, headDimV dv: Int) -> Bool {
        (try? tileDim(d, dv: dv, op: "", vName: "v")) != nil
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
