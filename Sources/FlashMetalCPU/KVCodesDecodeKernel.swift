import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `kv_codes_decode_*` on the cpu (kv_codec.c): one work item per chunk of
/// the query heads that share a kv head in one query row, so each key's
/// codes are unpacked once for all of them.
final class KVCodesDecodeKernel: CPUKernel {
    /// The dtype of a dense side, when one is.
    let dense: DType
    /// The dtype of q and the output.
    let io: DType
    let name: String

    init(_ key: PipelineKey) {
        name = key.kernel
        if case let .kvCodesDecode(i, d) = key.spec { (io, dense) = (i, d) } else { (io, dense) = (.f32, .f32) }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        let p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        let heads = Int(p.n_heads), kvHeads = Int(p.n_kv_heads), chunk = Int(FM_CPU_KVQ_HEAD_CHUNK)
        // The grid's x is tokens x H / heads_per_group (its y, the key splits, is 1 on the cpu).
        let tokens = d.grid.x * Int(p.heads_per_group) / heads
        let items = tokens * kvHeads * ((heads / kvHeads + chunk - 1) / chunk)
        // Keys split so every worker has work: shares of at least
        // minKeys keys, enough for 4 per worker. When the kv heads of one key
        // sit side by side (flash-attn's [B, cap, Hkv] and its pages), a work
        // item is a query row's share of keys over every kv head, read in
        // memory order; otherwise one chunk of heads of one kv head.
        let rows = items / max(kvHeads * ((heads / kvHeads + chunk - 1) / chunk), 1)
        let byRow = p.kv_strides.1 < p.kv_strides.2 && items > rows
        let units = byRow ? rows : items
        let keys = maxKeys(d, p)
        let want = (4 * pool.threads + units - 1) / max(units, 1)
        let nsplit = max(1, min(want, keys / Self.minKeys, Self.maxSplits))
        if nsplit == 1 && !byRow {
            try Self.withKernel(d, dense: dense, io: io, op: name) { pp, ap in
                pool.forEach(items) { _, item in fm_cpu_kv_codes_decode_item(pp, ap, Int64(item), 0, 1, nil) }
            }
            return
        }
        var pv = p
        let floats = Int(withUnsafePointer(to: &pv) { fm_cpu_kv_codes_part_floats($0) })
        let parts = try HostMemory.allocate(Float.self, count: floats * items * nsplit, op: name,
                                            what: "decode-over-codes partials")
        defer { HostMemory.free(parts) }
        try Self.withKernel(d, dense: dense, io: io, op: name) { pp, ap in
            pool.forEach(units * nsplit) { _, i in
                if byRow {
                    fm_cpu_kv_codes_decode_row(pp, ap, Int64(i / nsplit), Int32(i % nsplit), Int32(nsplit), parts)
                } else {
                    fm_cpu_kv_codes_decode_item(pp, ap, Int64(i / nsplit), Int32(i % nsplit), Int32(nsplit), parts)
                }
            }
            pool.forEach(items) { _, item in fm_cpu_kv_codes_decode_merge(pp, ap, Int64(item), Int32(nsplit), parts) }
        }
    }

    /// Runs `body` with pointers to a kv_codes_decode / kv_codes_prefill
    /// dispatch's params and kernel arguments (valid only inside it). The
    /// kernels read and write float32 rows: a 16-bit q (`io`) is widened
    /// first, and the output computed in a float32 copy of out (so rows the
    /// kernel leaves keep their values) rounded into out after.
    static func withKernel(_ d: Dispatch, dense: DType, io: DType, op: String,
                           _ body: (UnsafePointer<KVCodesDecodeParams>, UnsafePointer<FMCPUKVCodesAttnArgs>) -> Void) throws {
        var p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        var a = try args(d, dense: dense)
        guard io != .f32 else {
            withUnsafePointer(to: &p) { pp in withUnsafePointer(to: &a) { ap in body(pp, ap) } }
            return
        }
        let q = try d.buffer(KVCodesDecodeBuffer.q), out = try d.buffer(KVCodesDecodeBuffer.out)
        let (nq, no) = (q.elementCount ?? 0, out.elementCount ?? 0)
        let wide = try HostMemory.allocate(Float.self, count: max(nq + no, 1), op: op, what: "float32 q and out rows")
        defer { HostMemory.free(wide) }
        fm_cpu_widen_to_f32(q.data, q.dtype.rawValue, Int64(nq), wide)
        fm_cpu_widen_to_f32(out.data, out.dtype.rawValue, Int64(no), wide + nq)
        a.q = UnsafePointer(wide)
        a.o = wide + nq
        withUnsafePointer(to: &p) { pp in withUnsafePointer(to: &a) { ap in body(pp, ap) } }
        fm_cpu_round_from_f32(wide + nq, out.dtype.rawValue, Int64(no), out.data)
    }

    /// The kernel arguments of a kv_codes_decode / kv_codes_prefill dispatch.
    static func args(_ d: Dispatch, dense: DType) throws -> FMCPUKVCodesAttnArgs {
        func input<T>(_ i: Int, _ t: T.Type) throws -> UnsafePointer<T> {
            UnsafePointer(try d.buffer(i).data.assumingMemoryBound(to: T.self))
        }
        func optional<T>(_ i: Int, _ t: T.Type) throws -> UnsafeMutablePointer<T>? {
            d.bindings[i] == nil ? nil : try d.buffer(i).data.assumingMemoryBound(to: T.self)
        }
        return FMCPUKVCodesAttnArgs(
            q: try input(KVCodesDecodeBuffer.q, Float.self),
            k_codes: UnsafePointer(try optional(KVCodesDecodeBuffer.kCodes, UInt8.self)),
            k_norms: UnsafePointer(try optional(KVCodesDecodeBuffer.kNorms, Float.self)),
            v_codes: UnsafePointer(try optional(KVCodesDecodeBuffer.vCodes, UInt8.self)),
            v_norms: UnsafePointer(try optional(KVCodesDecodeBuffer.vNorms, Float.self)),
            o: try d.buffer(KVCodesDecodeBuffer.out).data.assumingMemoryBound(to: Float.self),
            seqlens: UnsafePointer(try optional(KVCodesDecodeBuffer.seqlens, Int32.self)),
            block_table: UnsafePointer(try optional(KVCodesDecodeBuffer.blockTable, Int32.self)),
            sinks: UnsafePointer(try optional(KVCodesDecodeBuffer.sinks, Float.self)),
            lse: try optional(KVCodesDecodeBuffer.lse, Float.self),
            k_dense: UnsafeRawPointer(try optional(KVCodesDecodeBuffer.kDense, UInt8.self)),
            v_dense: UnsafeRawPointer(try optional(KVCodesDecodeBuffer.vDense, UInt8.self)),
            dense_dtype: dense.rawValue,
            cu_seqlens_q: UnsafePointer(try optional(KVCodesDecodeBuffer.cuSeqlensQ, Int32.self)),
            cu_seqlens_k: UnsafePointer(try optional(KVCodesDecodeBuffer.cuSeqlensK, Int32.self)),
            alibi: UnsafePointer(try optional(KVCodesDecodeBuffer.alibi, Float.self)))
    }

    /// The fewest keys worth a share of their own, and the most shares.
    static let minKeys = 512
    static let maxSplits = 64

    /// The most keys one sequence has: its bound lengths (per-sequence
    /// counts, or varlen offsets), else kv_len.
    private func maxKeys(_ d: Dispatch, _ p: KVCodesDecodeParams) -> Int {
        var m = 0
        if d.bindings[KVCodesDecodeBuffer.cuSeqlensK] != nil,
           let c = try? d.buffer(KVCodesDecodeBuffer.cuSeqlensK).data.assumingMemoryBound(to: Int32.self) {
            for b in 0..<Int(p.batch) { m = max(m, Int(c[b + 1]) - Int(c[b])) }
        } else if d.bindings[KVCodesDecodeBuffer.seqlens] != nil,
                  let s = try? d.buffer(KVCodesDecodeBuffer.seqlens).data.assumingMemoryBound(to: Int32.self) {
            for b in 0..<Int(p.batch) { m = max(m, Int(s[b])) }
        } else {
            m = Int(p.kv_len)
        }
        return m
    }
}

/// `kv_codes_reduce_*` on the cpu: never dispatched there (the cpu's
/// kv_codes_decode splits keys over its workers and writes the output, so a
/// cpu decode plan has no reduce); running it is an internal error.
final class KVCodesReduceKernel: CPUKernel {
    func run(_ d: Dispatch, pool: WorkerPool) throws {
        throw FlashMetalError.internalError("cpu backend: \(d.kernel) is never dispatched to the cpu (its decode writes the output)")
    }
}

/// `kv_codes_prefill_*` on the cpu (kv_codec.c): one work item per run of
/// (query row, head) items of one kv head of one sequence (consecutive
/// threadgroups of the grid along x), sharing every decoded key tile; the
/// last rows of each sequence (under causal, the most keys) start first.
final class KVCodesPrefillKernel: CPUKernel {
    let dense: DType
    /// The dtype of q and the output.
    let io: DType
    let name: String

    init(_ key: PipelineKey) {
        name = key.kernel
        if case let .kvCodesPrefill(i, d) = key.spec { (io, dense) = (i, d) } else { (io, dense) = (.f32, .f32) }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        let items = Self.itemsPerWorkItem(d, threads: pool.threads), per = items / Int(FM_KVQ_PREFILL_ROWS)
        let (gx, gy) = ((d.grid.x + per - 1) / per, d.grid.y)
        var p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        let floats = Int(fm_cpu_kv_codes_prefill_scratch_floats(&p))
        let scratch = try HostMemory.allocate(Float.self, count: floats * pool.threads, op: name,
                                              what: "prefill-over-codes tiles")
        defer { HostMemory.free(scratch) }
        try KVCodesDecodeKernel.withKernel(d, dense: dense, io: io, op: name) { pp, ap in
            pool.forEach(gx * gy * d.grid.z) { w, i in
                let x = gx - 1 - i % gx, r = i / gx
                fm_cpu_kv_codes_prefill_items(pp, ap, Int64(x * items), Int32(items), Int64(r % gy), Int64(r / gy),
                                              scratch + w * floats)
            }
        }
    }

    /// Items per work item: as many as FM_CPU_KVQ_PREFILL_ITEMS allows (each
    /// decoded key tile then serves more of them) while every worker still
    /// gets two work items, in steps of FM_CPU_KVQ_PREFILL_STEP.
    static func itemsPerWorkItem(_ d: Dispatch, threads: Int) -> Int {
        let step = Int(FM_CPU_KVQ_PREFILL_STEP)
        let steps = (d.grid.x * Int(FM_KVQ_PREFILL_ROWS) + step - 1) / step  // of the longest sequence's kv head
        let heads = max(1, d.grid.y * d.grid.z)
        let split = max(1, (2 * threads + heads - 1) / heads)
        let want = (steps + split - 1) / split
        return step * max(1, min(want, Int(FM_CPU_KVQ_PREFILL_ITEMS) / step))
    }
}

/// `kv_codes_append_*` on the cpu (kv_codec.c): one work item per new row of
/// one kv head of one sequence.
final class KVCodesAppendKernel: CPUKernel {
    let input: DType

    init(_ key: PipelineKey) {
        if case let .kvCodesAppend(x) = key.spec { input = x } else { input = .f32 }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(KVCodesAppendBuffer.params, as: KVCodesAppendParams.self)
        func out<T>(_ i: Int, _ t: T.Type) throws -> UnsafeMutablePointer<T> {
            try d.buffer(i).data.assumingMemoryBound(to: T.self)
        }
        func opt<T>(_ i: Int, _ t: T.Type) throws -> UnsafeMutablePointer<T>? {
            d.bindings[i] == nil ? nil : try out(i, t)
        }
        var a = FMCPUKVCodesAppendArgs(
            k_new: UnsafeRawPointer(try d.buffer(KVCodesAppendBuffer.kNew).data),
            v_new: UnsafeRawPointer(try d.buffer(KVCodesAppendBuffer.vNew).data), dtype: input.rawValue,
            k_codes: try opt(KVCodesAppendBuffer.kCodes, UInt8.self), k_norms: try opt(KVCodesAppendBuffer.kNorms, Float.self),
            v_codes: try opt(KVCodesAppendBuffer.vCodes, UInt8.self), v_norms: try opt(KVCodesAppendBuffer.vNorms, Float.self),
            seqlens: UnsafePointer(try out(KVCodesAppendBuffer.seqlens, Int32.self)),
            block_table: d.bindings[KVCodesAppendBuffer.blockTable] == nil ? nil
                : UnsafePointer(try out(KVCodesAppendBuffer.blockTable, Int32.self)),
            k_dense: d.bindings[KVCodesAppendBuffer.kDense] == nil ? nil : try d.buffer(KVCodesAppendBuffer.kDense).data,
            v_dense: d.bindings[KVCodesAppendBuffer.vDense] == nil ? nil : try d.buffer(KVCodesAppendBuffer.vDense).data)
        let kvHeads = Int32(d.grid.y)
        withUnsafePointer(to: &p) { pp in
            withUnsafePointer(to: &a) { ap in
                pool.forEach(d.grid.count) { _, item in fm_cpu_kv_codes_append_item(pp, ap, kvHeads, Int64(item)) }
            }
        }
    }
}
