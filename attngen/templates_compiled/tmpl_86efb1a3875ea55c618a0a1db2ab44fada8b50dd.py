from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = 'prefill.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_varlen = resolve('varlen')
    l_0_module_name = resolve('module_name')
    l_0_head_dim = resolve('head_dim')
    l_0_head_dim_v = resolve('head_dim_v')
    l_0_mask = resolve('mask')
    l_0_alibi = resolve('alibi')
    l_0_bottom_right = resolve('bottom_right')
    l_0_chunk_size = resolve('chunk_size')
    l_0_sink_tokens = resolve('sink_tokens')
    l_0_sinks = resolve('sinks')
    l_0_dropout = resolve('dropout')
    l_0_gluon = resolve('gluon')
    l_0_tma = resolve('tma')
    l_0_lpt_group_heads = resolve('lpt_group_heads')
    l_0_backward = resolve('backward')
    l_0_host_code = resolve('host_code')
    l_0_score_code = l_0_common = l_0_step = l_0_varlen_code = l_0_key_phase = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_score_code = context.vars['score_code'] = environment.get_template('_scores.py.jinja', 'prefill.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code})
    context.exported_vars.discard('score_code')
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', 'prefill.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code})
    context.exported_vars.discard('common')
    l_0_step = context.vars['step'] = environment.get_template('_step.py.jinja', 'prefill.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code})
    context.exported_vars.discard('step')
    l_0_varlen_code = context.vars['varlen_code'] = environment.get_template('_varlen_sequence.py.jinja', 'prefill.py.jinja').make_module(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code})
    context.exported_vars.discard('varlen_code')
    def macro(l_1_comment, l_1_bounds, l_1_masked):
        t_2 = []
        if l_1_comment is missing:
            l_1_comment = undefined("parameter 'comment' was not provided", name='comment')
        if l_1_bounds is missing:
            l_1_bounds = undefined("parameter 'bounds' was not provided", name='bounds')
        if l_1_masked is missing:
            l_1_masked = undefined("parameter 'masked' was not provided", name='masked')
        pass
        t_2.extend((
            '    # ',
            str(l_1_comment),
            '\n    acc, l_i, m_i = _attn_fwd_inner(\n        acc, l_i, m_i, q, q_pos, first_q_pos, last_q_pos,\n        k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,',
        ))
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            t_2.append(
                ' k_desc, v_desc, desc_b, desc_h,',
            )
        t_2.extend((
            '\n        ',
            str(l_1_bounds),
            ', seqlen_k, qk_scale, slope_log2,\n',
        ))
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            t_2.append(
                '        offs_m, batch_head, seed, philox_offset, drop_threshold,\n',
            )
        t_2.extend((
            '        MASKED=',
            str(l_1_masked),
            ', BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,',
        ))
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            t_2.append(
                ' USE_TMA=USE_TMA,',
            )
        if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
            pass
            t_2.append(
                ' DROPOUT_ON=DROPOUT_ON,',
            )
        t_2.append(
            '\n    )',
        )
        return concat(t_2)
    context.exported_vars.add('key_phase')
    context.vars['key_phase'] = l_0_key_phase = Macro(environment, macro, 'key_phase', ('comment', 'bounds', 'masked'), False, False, False, context.eval_ctx.autoescape)
    template = environment.get_template('_header.py.jinja', 'prefill.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '"""Varlen prefill (forward) attention over packed sequences, FlashAttention-2 style and exact.\n'
    else:
        pass
        yield '"""Prefill (forward) attention, FlashAttention-2 style and exact.\n'
    yield '\nModule '
    yield str((undefined(name='module_name') if l_0_module_name is missing else l_0_module_name))
    yield '.\n\nNotation: B batch, HQ query heads, HKV key/value heads (HQ is a multiple of HKV;\nquery head h reads KV head h // (HQ // HKV)), M = Nq query rows, N = Nk key rows,\nD = '
    yield str((undefined(name='head_dim') if l_0_head_dim is missing else l_0_head_dim))
    yield ' the q/k head dim, DV = '
    yield str((undefined(name='head_dim_v') if l_0_head_dim_v is missing else l_0_head_dim_v))
    yield ' the value head dim. A program owns BLOCK_M\nquery rows of one (batch, head): its Q tile stays resident while K/V tiles of BLOCK_N\nrows stream past, with an online softmax (running max m_i and sum l_i, kept in the\nlog2 domain so exp2 can be used). No M x N tensor exists.\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield "\nSequences are packed as in flash-attn's varlen API: q [total_q, HQ, D] holds sequence b in\nrows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (likewise k, v with cu_seqlens_k); M and N are\nper sequence, so masks and alignment apply to each sequence on its own. The grid is sized\nfrom max_seqlen_q on the host; a program whose query block lies past its sequence's end\nreturns at once, so the host never reads the device's lengths.\n"
    yield '\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'none'):
        pass
        yield 'Every query row sees every key.'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield " ALiBi's bias is -slope * |i' - j| with i' = i + (N - M)\n(aligned bottom-right, flash-attn's convention)."
        yield '\n'
    elif (undefined(name='bottom_right') if l_0_bottom_right is missing else l_0_bottom_right):
        pass
        yield "Query row i sees key j through i' = i + (N - M): the diagonal is aligned bottom-right.\n"
    else:
        pass
        yield "Query row i sees key j through i' = i: the diagonal is aligned top-left.\n"
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield "It sees the keys of its own chunk up to i': i' // "
        yield str((undefined(name='chunk_size') if l_0_chunk_size is missing else l_0_chunk_size))
        yield ' * '
        yield str((undefined(name='chunk_size') if l_0_chunk_size is missing else l_0_chunk_size))
        yield " <= j <= i'.\n"
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield 'The first '
        yield str((undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens))
        yield " keys ignore the window's left side (sink tokens).\n"
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield "Each query head h has a learned sink logit s_h (`sinks`): one more term exp(s_h) in every\nrow's normaliser (and LSE) that takes no value.\n"
    yield '"""\n\n'
    yield str(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'spec_constants')))
    yield '\n\n'
    yield str(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'compile_constants')))
    yield '\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        template = environment.get_template('_dropout.py.jinja', 'prefill.py.jinja')
        gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
        try:
            for event in gen:
                yield event
        finally: gen.close()
    yield '\n'
    template = environment.get_template('_key_loop.py.jinja', 'prefill.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    yield '\n\n'
    if (undefined(name='gluon') if l_0_gluon is missing else l_0_gluon):
        pass
        template = environment.get_template('_gluon_kernel.py.jinja', 'prefill.py.jinja')
        gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
        try:
            for event in gen:
                yield event
        finally: gen.close()
        yield '\n\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield str(context.call(environment.getattr((undefined(name='varlen_code') if l_0_varlen_code is missing else l_0_varlen_code), 'store_nan_rows_kernel')))
        yield '\n\n\n'
    yield '@triton.jit\ndef _attn_fwd_kernel(\n    Q, K, V, Out, Lse, Slopes,'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield ' Sinks,'
    yield '\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '    CuSeqlensQ, CuSeqlensK, SequsedK,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    RngState,\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '    stride_qm, stride_qh, stride_qd,\n    stride_kn, stride_kh, stride_kd,\n    stride_vn, stride_vh, stride_vd,\n    stride_om, stride_oh, stride_od,\n    stride_lse_h,\n    num_q_heads, q_per_kv, num_m_blocks, total_q, total_k,\n'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield '    stride_slopes_b,\n'
    else:
        pass
        yield '    stride_qb, stride_qh, stride_qm, stride_qd,\n    stride_kb, stride_kh, stride_kn, stride_kd,\n    stride_vb, stride_vh, stride_vn, stride_vd,\n    stride_ob, stride_oh, stride_om, stride_od,\n    num_q_heads, q_per_kv, seqlen_q, seqlen_k, num_m_blocks,\n'
        if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
            pass
            yield '    stride_slopes_b,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    drop_threshold,\n'
    yield '    qk_scale,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    keep_scale,\n'
    if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
        pass
        yield '    k_desc, v_desc,\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '    USE_SEQUSED_K: tl.constexpr,\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    DROPOUT_ON: tl.constexpr,\n'
    yield '    STORE_LSE: tl.constexpr,\n    BLOCK_M: tl.constexpr,\n    BLOCK_N: tl.constexpr,\n'
    if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
        pass
        yield '    USE_TMA: tl.constexpr,\n'
    yield '):\n    tl.static_assert(BLOCK_N % 16 == 0)\n    tl.static_assert(BLOCK_M % 16 == 0)\n    pid = tl.program_id(0)\n'
    if (undefined(name='lpt_group_heads') if l_0_lpt_group_heads is missing else l_0_lpt_group_heads):
        pass
        yield '    # -- which tile: under causal, query block i sees i + 1 key blocks. Groups of\n    # '
        yield str((undefined(name='lpt_group_heads') if l_0_lpt_group_heads is missing else l_0_lpt_group_heads))
        yield " heads go heaviest first across the group (longest processing time first:\n    # few long programs per SM leave a shorter tail), and the group's K/V stays in L2.\n    group_programs = "
        yield str((undefined(name='lpt_group_heads') if l_0_lpt_group_heads is missing else l_0_lpt_group_heads))
        yield ' * num_m_blocks\n    group_first = (pid // group_programs) * '
        yield str((undefined(name='lpt_group_heads') if l_0_lpt_group_heads is missing else l_0_lpt_group_heads))
        yield '\n    group_heads = tl.minimum('
        yield str((undefined(name='lpt_group_heads') if l_0_lpt_group_heads is missing else l_0_lpt_group_heads))
        yield ', tl.num_programs(0) // num_m_blocks - group_first)\n    rank = pid % group_programs\n    m_block = num_m_blocks - 1 - rank // group_heads\n    batch_head = group_first + rank % group_heads\n'
    else:
        pass
        yield '    # -- which tile: the query blocks of one head are adjacent programs, so they share\n    # K/V in L2; the last (under causal the most expensive) block of a head goes first.\n    m_block = num_m_blocks - 1 - pid % num_m_blocks\n    batch_head = pid // num_m_blocks\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield str(context.call(environment.getattr((undefined(name='varlen_code') if l_0_varlen_code is missing else l_0_varlen_code), 'sequence_bounds')))
        yield '\n'
    else:
        pass
        yield '    off_b = (batch_head // num_q_heads).to(tl.int64)\n    off_h = (batch_head % num_q_heads).to(tl.int64)\n    off_hkv = off_h // q_per_kv\n    q_base = Q + off_b * stride_qb + off_h * stride_qh\n    k_base = K + off_b * stride_kb + off_hkv * stride_kh\n    v_base = V + off_b * stride_vb + off_hkv * stride_vh\n    o_base = Out + off_b * stride_ob + off_h * stride_oh\n'
        if (undefined(name='tma') if l_0_tma is missing else l_0_tma):
            pass
            yield '    desc_b = off_b.to(tl.int32)\n    desc_h = off_hkv.to(tl.int32)\n'
        yield '\n    q_start = m_block * BLOCK_M\n'
    yield "    offs_m = q_start + tl.arange(0, BLOCK_M)\n    offs_d = tl.arange(0, _BLOCK_D)\n    offs_dv = tl.arange(0, _BLOCK_DV)\n    row_ok = offs_m < seqlen_q\n    # -- aligned query positions i' and the key range this tile can see ---------------\n"
    if (undefined(name='bottom_right') if l_0_bottom_right is missing else l_0_bottom_right):
        pass
        yield '    diagonal = seqlen_k - seqlen_q\n'
    elif ((undefined(name='alibi') if l_0_alibi is missing else l_0_alibi) and ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'none')):
        pass
        yield "    diagonal = seqlen_k - seqlen_q  # ALiBi's distance without a mask: flash-attn's alignment\n"
    else:
        pass
        yield '    diagonal = 0\n'
    yield '    q_pos = offs_m + diagonal\n    first_q_pos = q_start + diagonal\n    last_q_pos = tl.minimum(q_start + BLOCK_M, seqlen_q) - 1 + diagonal\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='score_code') if l_0_score_code is missing else l_0_score_code), 'key_ranges')), '\n'))
    yield '\n    # -- the resident Q tile ------------------------------------------------------------\n    q_rows = offs_m.to(tl.int64)\n    q_ptrs = q_base + q_rows[:, None] * stride_qm + offs_d[None, :] * stride_qd\n    q = tl.load(q_ptrs, mask=row_ok[:, None]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_d'), 'None, :'))
    yield ', other=0.0)\n'
    if (undefined(name='alibi') if l_0_alibi is missing else l_0_alibi):
        pass
        yield "    # [HQ] slopes have stride_slopes_b 0, [B, HQ] ones their row stride: off_b < B, off_h < HQ\n    # (the launcher checked the shape); the offset in int64 (a view's row stride may be large).\n    slope_log2 = tl.load(Slopes + off_b.to(tl.int64) * stride_slopes_b + off_h) * _LOG2E_C\n"
    else:
        pass
        yield '    slope_log2 = 0.0\n'
    if (undefined(name='dropout') if l_0_dropout is missing else l_0_dropout):
        pass
        yield '    # The RNG state lives on the device (CUDA-graph safe): (seed, Philox offset).\n    if DROPOUT_ON:\n        seed = tl.load(RngState)\n        philox_offset = tl.load(RngState + 1)\n    else:\n        seed = 0\n        philox_offset = 0\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'init_state'), 'BLOCK_M'))
    yield '\n'
    if (undefined(name='sink_tokens') if l_0_sink_tokens is missing else l_0_sink_tokens):
        pass
        yield str(context.call((undefined(name='key_phase') if l_0_key_phase is missing else l_0_key_phase), "the sink tokens' keys left of the window: masked", '0, sink_hi', True))
        yield '\n'
    if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'sliding_window'):
        pass
        yield str(context.call((undefined(name='key_phase') if l_0_key_phase is missing else l_0_key_phase), "keys left of the window's fully visible part: masked", 'lo, full_lo', True))
        yield '\n'
    elif ((undefined(name='mask') if l_0_mask is missing else l_0_mask) == 'chunked'):
        pass
        yield str(context.call((undefined(name='key_phase') if l_0_key_phase is missing else l_0_key_phase), "keys of the first row's chunk left of the part every row sees: masked", 'lo, full_lo', True))
        yield '\n'
    yield str(context.call((undefined(name='key_phase') if l_0_key_phase is missing else l_0_key_phase), 'keys every row of the tile sees: no mask', 'full_lo, full_hi', False))
    yield '\n'
    yield str(context.call((undefined(name='key_phase') if l_0_key_phase is missing else l_0_key_phase), ('keys at the diagonal' if ((undefined(name='mask') if l_0_mask is missing else l_0_mask) != 'none') else 'the last, partial key block'), 'full_hi, hi', True))
    yield '\n    # -- epilogue -----------------------------------------------------------------------\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'fold_sink')))
        yield '\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'normalise')))
    yield '\n    o_ptrs = o_base + q_rows[:, None] * stride_om + offs_dv[None, :] * stride_od\n    o_mask = row_ok[:, None]'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'pad_dv'), 'None, :'))
    yield '\n    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)\n    if STORE_LSE:\n'
    yield str(context.call(environment.getattr((undefined(name='step') if l_0_step is missing else l_0_step), 'row_lse'), 'lse', pad='        '))
    yield '\n'
    if (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen):
        pass
        yield '        lse_ptrs = Lse + off_h * stride_lse_h + q_offset + offs_m\n'
    else:
        pass
        yield '        lse_ptrs = Lse + batch_head.to(tl.int64) * seqlen_q + offs_m\n'
    yield '        tl.store(lse_ptrs, lse, mask=row_ok)\n\n\n'
    if (undefined(name='backward') if l_0_backward is missing else l_0_backward):
        pass
        template = environment.get_template('_backward.py.jinja', 'prefill.py.jinja')
        gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
        try:
            for event in gen:
                yield event
        finally: gen.close()
    template = environment.get_template('_launch.py.jinja', 'prefill.py.jinja')
    gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
    try:
        for event in gen:
            yield event
    finally: gen.close()
    if (undefined(name='backward') if l_0_backward is missing else l_0_backward):
        pass
        template = environment.get_template('_autograd.py.jinja', 'prefill.py.jinja')
        gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
        try:
            for event in gen:
                yield event
        finally: gen.close()
    if (not (undefined(name='varlen') if l_0_varlen is missing else l_0_varlen)):
        pass
        template = environment.get_template('_flash_entry.py.jinja', 'prefill.py.jinja')
        gen = template.root_render_func(template.new_context(context.get_all(), True, {'common': l_0_common, 'key_phase': l_0_key_phase, 'score_code': l_0_score_code, 'step': l_0_step, 'varlen_code': l_0_varlen_code}))
        try:
            for event in gen:
                yield event
        finally: gen.close()
    yield '\n\n'
    yield str((undefined(name='host_code') if l_0_host_code is missing else l_0_host_code))
    yield '\n'

blocks = {}
debug_info = '1=34&2=36&3=38&4=40&5=42&6=53&9=56&11=63&12=66&15=73&23=92&24=98&30=105&34=107&38=111&47=115&48=118&50=122&55=128&56=131&58=135&59=138&61=140&67=144&69=146&70=148&71=150&74=157&77=164&78=166&82=173&83=175&91=178&93=182&96=185&99=188&106=191&115=197&119=200&123=204&126=207&129=210&132=213&138=217&145=221&147=224&149=226&150=228&151=230&161=235&162=237&171=242&183=247&185=250&193=257&197=259&198=261&205=267&214=270&215=272&216=274&218=276&219=278&220=280&221=282&223=284&224=286&226=288&227=290&229=292&231=294&234=296&235=298&243=305&244=307&246=313&247=319&248=321&250=327&251=329&255=336'