import CFlashMetal
import FlashMetalCore

/// fm_route_attention of flashmetal.h: the kernel AttentionRouter picks for
/// one call of the front door, with the reason as text.
@_cdecl("fm_route_attention")
public func fm_route_attention(_ call: UnsafePointer<FMRouteCall>?, _ out: UnsafeMutablePointer<FMRoute>?,
                               _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = AttentionRouter.op
        guard let c = call?.pointee else { throw FlashMetalError.value(op, "call is null", arg: "call") }
        guard let out = out else { throw FlashMetalError.value(op, "out is null", arg: "out") }
        guard let dtype = DType(rawValue: c.dtype), PrefillCapability.ioTypes.contains(dtype) else {
            throw FlashMetalError.type(op, "dtype must be float32, float16 or bfloat16 (FMDType), got \(c.dtype)",
                                       arg: "dtype")
        }
        // Bounded to int32 (the kernels' range), so the router's sums of them cannot overflow.
        let limit = Int64(Int32.max)
        if [c.query_rows, c.keys, c.head_dim, c.head_dim_v].contains(where: { $0 < 1 || $0 > limit }) || c.window < 0 {
            throw FlashMetalError.value(op, "query_rows, keys, head_dim and head_dim_v must be in 1...\(limit) and "
                + "window >= 0, got \(c.query_rows), \(c.keys), \(c.head_dim), \(c.head_dim_v), \(c.window)",
                                        arg: "call")
        }
        if c.query_offset < -limit || c.query_offset > limit {
            throw FlashMetalError.value(op, "query_offset must be in -\(limit)...\(limit), got \(c.query_offset)",
                                        arg: "call")
        }
        let route = try AttentionRouter.route(AttentionRouter.Call(
            dtype: dtype, queryRows: Int(c.query_rows), headDim: Int(c.head_dim), headDimV: Int(c.head_dim_v),
            keys: Int(c.keys), mask: c.mask != 0, maskIsKeyRanges: c.mask_is_key_ranges != 0, causal: c.causal != 0,
            queryOffset: Int(c.query_offset), window: c.window > 0 ? Int(c.window) : nil, sinks: c.sinks != 0))
        out.pointee.kernel = route.kernel.rawValue
        withUnsafeMutableBytes(of: &out.pointee.reason) { raw in
            let buf = raw.bindMemory(to: CChar.self)
            writeMessage(route.reason, buf.baseAddress, buf.count)
        }
    }
}

/// fm_mask_key_ranges of flashmetal.h: MaskKeyRanges.find over a mask.
@_cdecl("fm_mask_key_ranges")
public func fm_mask_key_ranges(_ mask: UnsafePointer<FMTensor>?, _ causal: Int32, _ queryPosition: Int32,
                               _ window: Int32, _ out: UnsafePointer<FMTensor>?, _ found: UnsafeMutablePointer<Int32>?,
                               _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = MaskKeyRanges.op
        guard let found else { throw FlashMetalError.value(op, "found is null", arg: "found") }
        if window < 0 { throw FlashMetalError.value(op, "window must be >= 0 (0 = none), got \(window)", arg: "window") }
        found.pointee = try MaskKeyRanges.find(
            try TensorRef(mask, op: op, name: "mask"), causal: causal != 0, queryPosition: Int(queryPosition),
            window: window > 0 ? Int(window) : nil, out: try TensorRef(out, op: op, name: "out")) ? 1 : 0
    }
}

/// fm_plan_attention of flashmetal.h: AttentionPlan over the descriptors'
/// dtypes and shapes (their data is not read).
@_cdecl("fm_plan_attention")
public func fm_plan_attention(_ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
                              _ v: UnsafePointer<FMTensor>?, _ sinks: UnsafePointer<FMTensor>?,
                              _ call: UnsafePointer<FMAttentionCall>?, _ out: UnsafeMutablePointer<FMAttentionPlan>?,
                              _ err: UnsafeMutablePointer<FMError>?) -> Int32 {
    guarded(err) {
        let op = AttentionPlan.op
        guard let c = call?.pointee else { throw FlashMetalError.value(op, "call is null", arg: "call") }
        guard let out else { throw FlashMetalError.value(op, "out is null", arg: "out") }
        let (qt, kt, vt) = (try TensorRef(q, op: op, name: "query"), try TensorRef(k, op: op, name: "key"),
                            try TensorRef(v, op: op, name: "value"))
        let sinksShape = sinks == nil ? nil : try TensorRef(sinks, op: op, name: "sinks").shape
        let plan = try AttentionPlan.plan(
            q: (qt.dtype, qt.shape), k: (kt.dtype, kt.shape), v: (vt.dtype, vt.shape), sinks: sinksShape,
            AttentionPlan.Options(
                scale: c.has_scale != 0 ? c.scale : nil, softcap: c.softcap,
                window: c.has_window != 0 ? Int(c.window) : nil, kvLen: c.has_kv_len != 0 ? Int(c.kv_len) : nil,
                causalBias: c.has_causal_bias != 0 ? (Int(c.bias_query_rows), Int(c.bias_keys)) : nil,
                enableGQA: c.enable_gqa != 0, bottomRight: c.bottom_right != 0))
        out.pointee.kind = plan.kind.rawValue
        out.pointee.batch = Int64(plan.batch)
        out.pointee.heads = Int64(plan.heads)
        out.pointee.kv_heads = Int64(plan.kvHeads)
        out.pointee.query_rows = Int64(plan.queryRows)
        out.pointee.head_dim = Int64(plan.headDim)
        out.pointee.head_dim_v = Int64(plan.headDimV)
        out.pointee.capacity = Int64(plan.capacity)
        out.pointee.keys = Int64(plan.keys)
        out.pointee.query_offset = Int64(plan.queryOffset)
        withUnsafeMutableBytes(of: &out.pointee.reason) { raw in
            let buf = raw.bindMemory(to: CChar.self)
            writeMessage(plan.reason, buf.baseAddress, buf.count)
        }
    }
}
