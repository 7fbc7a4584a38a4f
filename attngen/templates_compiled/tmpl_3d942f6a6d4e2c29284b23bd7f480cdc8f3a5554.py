from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_backward_launch.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_sinks = resolve('sinks')
    l_0_fwd_config = resolve('fwd_config')
    l_0_dropout = resolve('dropout')
    l_0_dtype = resolve('dtype')
    l_0_alibi = resolve('alibi')
    pass
    yield 'def _strides4(t):\n    """(batch, head, row, dim) strides; packed [T, H, D] tensors have batch stride 0."""\n    return (0, t.stride(1), t.stride(0), t.stride(2)) if t.dim() == 3 else tuple(t.stride())\n\n\ndef _backward(\n    dout, q, k, v, out, lse, dlse, sm_scale, alibi_slopes, dropout, lengths'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', sinks'
    yield ',\n    *, deterministic=True\n):\n    """dq, dk, dv'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', dsinks'
    yield ': the dQ kernel (which stores delta'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield " and each program's share of\n    d sinks, summed here in a fixed order"
    yield ') then the dK/dV kernel. `lengths` is\n    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed sequences.\n\n    deterministic=False: five products, not seven. The dQ kernel forms delta alone\n    (DELTA_ONLY'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ', and d sinks as before: still summed in a fixed order'
    yield '), and the dK/dV kernel\n    (ATOMIC_DQ, at BWD_DKDV_ATOMIC_CONFIG) adds each key block\'s dS @ K into an fp32 dQ by\n    atomics, whose order varies from run to run on a GPU (the last bits of dQ with it); where\n    BWD_DKDV_ATOMIC_CONFIG is None (no atomic config fits), the deterministic kernels."""\n    deterministic = deterministic or BWD_DKDV_ATOMIC_CONFIG is None\n    varlen = lengths is not None\n    alloc = torch.zeros_like if varlen else torch.empty_like\n    # (GRADS, config) of each dK/dV launch: 3 both gradients, 1 dV, 2 dK\n    dkdv_launches = ((3, BWD_DKDV_CONFIG),) if BWD_DKDV_SPLIT is None else (\n        (1, BWD_DKDV_SPLIT[0]), (2, BWD_DKDV_SPLIT[1]))\n    if not deterministic:  # the launch with dK (GRADS & 2) adds dQ, at its own config\n        dkdv_launches = tuple((grads, BWD_DKDV_ATOMIC_CONFIG if grads & 2 else config)\n                              for grads, config in dkdv_launches)\n    dk, dv = alloc(k), alloc(v)\n    # The atomic path\'s dQ: fp32, zeroed, q\'s layout where torch keeps it (zeros_like)\n    dq = alloc(q) if deterministic else torch.zeros_like(q, dtype=torch.float32)\n    lse = lse.contiguous()\n    delta = torch.zeros_like(lse)\n    dlse = None if dlse is None else dlse.contiguous()\n    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]\n    q_per_kv = num_q_heads // num_kv_heads\n    if varlen:\n        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = lengths\n        batch = cu_seqlens_q.numel() - 1\n        # Rows a sequence may have: those the forward\'s grid covered, and the keys the dK/dV\n        # grid covers (max_seqlen_k is a bound here); a sequence beyond gets NaN gradients.\n        block_m = '
    yield str((undefined(name='fwd_config') if l_0_fwd_config is missing else l_0_fwd_config))
    yield '["BLOCK_M"]\n        max_rows_q = triton.cdiv(max_seqlen_q, block_m) * block_m\n        block_n = max(config["BLOCK_N"] for _, config in dkdv_launches)\n        max_rows_k = triton.cdiv(max_seqlen_k, block_n) * block_n\n        lse_strides = (0, lse.stride(0))\n        rows_q, rows_k = max_rows_q, max_rows_k\n        sizes = (q.shape[0], k.shape[0], max_rows_q, max_rows_k)\n        index_args = (cu_seqlens_q, cu_seqlens_k)\n    else:\n        batch, rows_q, rows_k = q.shape[0], q.shape[2], k.shape[2]\n        lse_strides = (lse.stride(0), lse.stride(1))\n        sizes = (rows_q, rows_k)\n        index_args = ()\n    qk_scale = _kernel_scale(sm_scale)\n    slopes_arg = q if alibi_slopes is None else alibi_slopes\n    # The forward\'s slopes, checked again (attention_backward takes them from its caller);\n    # the kernels read [B, HQ] ones at their batch stride, [HQ] ones at stride 0.\n    stride_slopes_b = _check_alibi(alibi_slopes, num_q_heads, q, batch)\n    slope_args = (stride_slopes_b,) if ALIBI else ()\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    drop = _dropout_launch(dropout, q)\n    rng_args = (drop["RngState"],)\n    drop_args = (drop["drop_threshold"], drop["keep_scale"])\n    drop_flags = {"DROPOUT_ON": drop["DROPOUT_ON"]}\n'
    else:
        pass
        yield '    rng_args = drop_args = ()\n    drop_flags = {}\n'
    yield '    launch_options = {}\n'
    if ((undefined(name='dtype') if l_0_dtype is missing else l_0_dtype) == 'fp32'):
        pass
        yield '    launch_options["enable_fp_fusion"] = False  # the forward\'s scores, rounded the same way\n'
    yield '    num_m_blocks = triton.cdiv(rows_q, BWD_DQ_CONFIG["BLOCK_M"])\n    dq_programs = num_m_blocks * batch * num_q_heads\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield "    # One fp32 per dQ program (batch, head, query block); programs past their sequence's\n    # end leave 0.\n    dsink_partial = torch.zeros(dq_programs, dtype=torch.float32, device=q.device)\n    sink_args = (sinks, dsink_partial)\n"
    else:
        pass
        yield '    sink_args = ()\n'
    yield '    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():\n        if dq_programs and q.numel():\n            _check_grid(dq_programs)\n            _attn_bwd_dq_kernel[(dq_programs,)](\n                q, k, v, out, dout, dq, lse, lse if dlse is None else dlse, delta, slopes_arg,\n                *sink_args, *rng_args, *index_args,\n                *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out),\n                *_strides4(dout), *_strides4(dq), *lse_strides,\n                num_q_heads, q_per_kv, *sizes, num_m_blocks, *slope_args, qk_scale, sm_scale,\n                *drop_args,\n                HAS_DLSE=dlse is not None, **drop_flags,\n                BLOCK_M=BWD_DQ_CONFIG["BLOCK_M"], BLOCK_N=BWD_DQ_CONFIG["BLOCK_N"],\n                DELTA_ONLY=not deterministic,\n                num_warps=BWD_DQ_CONFIG["num_warps"], num_stages=BWD_DQ_CONFIG["num_stages"],\n                **launch_options,\n            )\n        for grads, config in dkdv_launches if k.numel() else ():\n            num_n_blocks = triton.cdiv(rows_k, config["BLOCK_N"])\n            dkdv_programs = num_n_blocks * batch * num_kv_heads\n            if not dkdv_programs:\n                continue\n            _check_grid(dkdv_programs)\n            _attn_bwd_dkdv_kernel[(dkdv_programs,)](\n                q, k, v, dout, dk, dv, lse, delta, dq, slopes_arg, *rng_args, *index_args,\n                *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout),\n                *_strides4(dk), *_strides4(dv), *_strides4(dq), *lse_strides,\n                num_q_heads, q_per_kv, *sizes, num_n_blocks, *slope_args, qk_scale, sm_scale,\n                *drop_args,\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield '                GROUP_MAX=triton.next_power_of_2(q_per_kv),\n'
    yield '                **drop_flags,\n                BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], GRADS=grads,\n                ATOMIC_DQ=not deterministic and bool(grads & 2),\n                num_warps=config["num_warps"], num_stages=config["num_stages"],\n                **launch_options,\n            )\n    if not deterministic:\n        dq = dq.to(q.dtype)  # already scaled by sm_scale (a no-op for fp32)\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '    # The sum over batches and query blocks in torch: the same order on every run.\n    dsinks = dsink_partial.view(batch, num_q_heads, num_m_blocks).sum((0, 2))\n    return dq, dk, dv, dsinks\n'
    else:
        pass
        yield '    return dq, dk, dv\n'

blocks = {}
debug_info = '12=17&15=21&20=29&46=33&65=35&75=42&80=46&116=53&127=57'