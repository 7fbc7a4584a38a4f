from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_common.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_spec_constants = l_0_compile_constants = l_0_check_alibi = l_0_check_sinks = l_0_check_sm_scale = missing
    pass
    def macro():
        t_1 = []
        l_1_gluon = resolve('gluon')
        l_1_softcap = resolve('softcap')
        l_1_tma = resolve('tma')
        l_1_head_dim = resolve('head_dim')
        l_1_head_dim_v = resolve('head_dim_v')
        l_1_dtype_name = resolve('dtype_name')
        l_1_mask = resolve('mask')
        l_1_causal_align = resolve('causal_align')
        l_1_window_left = resolve('window_left')
        l_1_window_right = resolve('window_right')
        l_1_alibi = resolve('alibi')
        l_1_sinks = resolve('sinks')
        l_1_chunk_size = resolve('chunk_size')
        l_1_sink_tokens = resolve('sink_tokens')
        l_1_block_m = resolve('block_m')
        l_1_block_n = resolve('block_n')
        l_1_num_warps = resolve('num_warps')
        l_1_num_stages = resolve('num_stages')
        l_1_shorter_configs = resolve('shorter_configs')
        pass
        t_1.append(
            'import contextlib\nimport math\nimport os\n',
        )
        if (undefined(name='gluon') if l_1_gluon is missing else l_1_gluon):
            pass
            t_1.append(
                'import threading\n',
            )
        t_1.append(
            '\nimport torch\nimport triton\nimport triton.language as tl\n',
        )
        if (undefined(name='softcap') if l_1_softcap is missing else l_1_softcap):
            pass
            t_1.append(
                'from triton.language.extra import libdevice\n',
            )
        if (undefined(name='tma') if l_1_tma is missing else l_1_tma):
            pass
            t_1.append(
                'from triton.tools.tensor_descriptor import TensorDescriptor\n',
            )
        if (undefined(name='gluon') if l_1_gluon is missing else l_1_gluon):
            pass
            t_1.append(
                'from triton.experimental import gluon\nfrom triton.experimental.gluon import language as gl\nfrom triton.experimental.gluon.language.nvidia.hopper import (\n    fence_async_shared,\n    mbarrier,\n    tma,\n    warpgroup_mma,\n    warpgroup_mma_wait,\n)\nfrom triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor\n',
            )
        t_1.extend((
            '\nHEAD_DIM = ',
            str((undefined(name='head_dim') if l_1_head_dim is missing else l_1_head_dim)),
            '\nHEAD_DIM_V = ',
            str((undefined(name='head_dim_v') if l_1_head_dim_v is missing else l_1_head_dim_v)),
            '\nDTYPE = torch.',
            str((undefined(name='dtype_name') if l_1_dtype_name is missing else l_1_dtype_name)),
            '\nMASK = "',
            str((undefined(name='mask') if l_1_mask is missing else l_1_mask)),
            '"\nCAUSAL_ALIGN = "',
            str((undefined(name='causal_align') if l_1_causal_align is missing else l_1_causal_align)),
            '"\n',
        ))
        if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'sliding_window'):
            pass
            t_1.extend((
                'WINDOW = (',
                str((undefined(name='window_left') if l_1_window_left is missing else l_1_window_left)),
                ', ',
                str((undefined(name='window_right') if l_1_window_right is missing else l_1_window_right)),
                ')\n',
            ))
        t_1.extend((
            'SOFTCAP = ',
            str((undefined(name='softcap') if l_1_softcap is missing else l_1_softcap)),
            '\nALIBI = ',
            str((undefined(name='alibi') if l_1_alibi is missing else l_1_alibi)),
            '\n',
        ))
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_1.append(
                "SINKS = True  # learned sink logits [HQ] in every row's normaliser (the `sinks` argument)\n",
            )
        if (undefined(name='chunk_size') if l_1_chunk_size is missing else l_1_chunk_size):
            pass
            t_1.extend((
                'CHUNK_SIZE = ',
                str((undefined(name='chunk_size') if l_1_chunk_size is missing else l_1_chunk_size)),
                '\n',
            ))
        if (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
            pass
            t_1.extend((
                'SINK_TOKENS = ',
                str((undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens)),
                '\n',
            ))
        t_1.extend((
            'CONFIG = {"BLOCK_M": ',
            str((undefined(name='block_m') if l_1_block_m is missing else l_1_block_m)),
            ', "BLOCK_N": ',
            str((undefined(name='block_n') if l_1_block_n is missing else l_1_block_n)),
            ', "num_warps": ',
            str((undefined(name='num_warps') if l_1_num_warps is missing else l_1_num_warps)),
            ', "num_stages": ',
            str((undefined(name='num_stages') if l_1_num_stages is missing else l_1_num_stages)),
            '}',
        ))
        if (undefined(name='shorter_configs') if l_1_shorter_configs is missing else l_1_shorter_configs):
            pass
            t_1.append(
                '\n# Configs measured faster on shorter sequences: (longest sequence served, config), ascending;\n# CONFIG serves longer ones. `config_for` picks.\nCONFIGS_BY_SEQLEN = [\n',
            )
            for l_2_literal in (undefined(name='shorter_configs') if l_1_shorter_configs is missing else l_1_shorter_configs):
                _loop_vars = {}
                pass
                t_1.extend((
                    '    ',
                    str(l_2_literal),
                    ',\n',
                ))
            l_2_literal = missing
            t_1.append(
                ']',
            )
        return concat(t_1)
    context.exported_vars.add('spec_constants')
    context.vars['spec_constants'] = l_0_spec_constants = Macro(environment, macro, 'spec_constants', (), False, False, False, context.eval_ctx.autoescape)
    def macro():
        t_2 = []
        l_1_block_d = resolve('block_d')
        l_1_block_dv = resolve('block_dv')
        l_1_mask = resolve('mask')
        l_1_window_left = resolve('window_left')
        l_1_window_right = resolve('window_right')
        l_1_chunk_size = resolve('chunk_size')
        l_1_sink_tokens = resolve('sink_tokens')
        l_1_softcap = resolve('softcap')
        pass
        t_2.extend((
            '_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"\n_LOG2E = 1.4426950408889634\n\n# Compile-time constants of the kernels (Triton reads globals only as tl.constexpr).\n# Head dims are padded to powers of two for tl.dot; loads and stores mask the padding.\n_HEAD_DIM = tl.constexpr(HEAD_DIM)\n_HEAD_DIM_V = tl.constexpr(HEAD_DIM_V)\n_BLOCK_D = tl.constexpr(',
            str((undefined(name='block_d') if l_1_block_d is missing else l_1_block_d)),
            ')\n_BLOCK_DV = tl.constexpr(',
            str((undefined(name='block_dv') if l_1_block_dv is missing else l_1_block_dv)),
            ')\n_LOG2E_C = tl.constexpr(_LOG2E)\n',
        ))
        if ((undefined(name='mask') if l_1_mask is missing else l_1_mask) == 'sliding_window'):
            pass
            t_2.extend((
                '_WINDOW_LEFT = tl.constexpr(',
                str((undefined(name='window_left') if l_1_window_left is missing else l_1_window_left)),
                ')\n_WINDOW_RIGHT = tl.constexpr(',
                str((undefined(name='window_right') if l_1_window_right is missing else l_1_window_right)),
                ')\n',
            ))
        if (undefined(name='chunk_size') if l_1_chunk_size is missing else l_1_chunk_size):
            pass
            t_2.append(
                '_CHUNK_SIZE = tl.constexpr(CHUNK_SIZE)\n',
            )
        if (undefined(name='sink_tokens') if l_1_sink_tokens is missing else l_1_sink_tokens):
            pass
            t_2.append(
                '_SINK_TOKENS = tl.constexpr(SINK_TOKENS)\n',
            )
        if (undefined(name='softcap') if l_1_softcap is missing else l_1_softcap):
            pass
            t_2.append(
                "_SOFTCAP_LOG2 = tl.constexpr(SOFTCAP * _LOG2E)\n_INTERPRETED = tl.constexpr(_INTERPRET)\n\n\n@triton.jit\ndef _tanh(x):\n    # Note: the softcapped score is softcap * tanh(s / softcap), so tanh's absolute error is\n    # multiplied by softcap: it must be accurate to an fp32 ulp. On the GPU libdevice's tanh\n    # is; the interpreter has no libdevice, so it evaluates (1 - e) / (1 + e), e = exp(-2|x|),\n    # in float64 (no cancellation near 0, no overflow) and rounds once.\n    if _INTERPRETED:\n        x64 = x.to(tl.float64)\n        e = tl.exp(-2.0 * tl.abs(x64))\n        t = (1.0 - e) / (1.0 + e)\n        return tl.where(x64 < 0, -t, t).to(tl.float32)\n    else:\n        return libdevice.tanh(x)\n",
            )
        return concat(t_2)
    context.exported_vars.add('compile_constants')
    context.vars['compile_constants'] = l_0_compile_constants = Macro(environment, macro, 'compile_constants', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_3 = []
        l_1_alibi = resolve('alibi')
        pass
        if (undefined(name='alibi') if l_1_alibi is missing else l_1_alibi):
            pass
            t_3.append(
                '    shapes = [(num_q_heads,)] if batch is None else [(num_q_heads,), (batch, num_q_heads)]\n    allowed = " or ".join(str(shape) for shape in shapes)\n    if not isinstance(alibi_slopes, torch.Tensor):\n        raise ValueError(f"alibi_slopes: this kernel was built with alibi: true; pass {allowed} "\n                         f"float32, got {type(alibi_slopes).__name__}")\n    if alibi_slopes.shape not in shapes or alibi_slopes.dtype != torch.float32:\n        raise ValueError(\n            f"alibi_slopes: expected shape {allowed} float32, "\n            f"got {tuple(alibi_slopes.shape)} {alibi_slopes.dtype}"\n        )\n    if alibi_slopes.device != q.device:\n        raise ValueError(f"alibi_slopes: expected device {q.device}, got {alibi_slopes.device}")\n    if alibi_slopes.shape[-1] > 1 and alibi_slopes.stride(-1) != 1:\n        raise ValueError("alibi_slopes: expected a contiguous tensor (its last dim read with "\n                         f"stride 1), got strides {alibi_slopes.stride()}")\n    return 0 if alibi_slopes.dim() == 1 else alibi_slopes.stride(0)\n',
            )
        else:
            pass
            t_3.append(
                '    if alibi_slopes is not None:\n        raise ValueError("alibi_slopes: this kernel was built with alibi: false; pass None")\n    return 0\n',
            )
        return concat(t_3)
    context.exported_vars.add('check_alibi')
    context.vars['check_alibi'] = l_0_check_alibi = Macro(environment, macro, 'check_alibi', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_4 = []
        l_1_sinks = resolve('sinks')
        pass
        if (undefined(name='sinks') if l_1_sinks is missing else l_1_sinks):
            pass
            t_4.append(
                '    if not isinstance(sinks, torch.Tensor):\n        raise ValueError("sinks: this kernel was built with sinks: true; pass [HQ] fp32")\n    if sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32:\n        raise ValueError(\n            f"sinks: expected shape ({num_q_heads},) float32, "\n            f"got {tuple(sinks.shape)} {sinks.dtype}"\n        )\n    if sinks.device != q.device:\n        raise ValueError(f"sinks: expected device {q.device}, got {sinks.device}")\n    if not sinks.is_contiguous():\n        raise ValueError("sinks: expected a contiguous tensor (read with stride 1), got "\n                         f"strides {sinks.stride()}")\n',
            )
        else:
            pass
            t_4.append(
                '    if sinks is not None:\n        raise ValueError("sinks: this kernel was built with sinks: false; pass None")\n',
            )
        return concat(t_4)
    context.exported_vars.add('check_sinks')
    context.vars['check_sinks'] = l_0_check_sinks = Macro(environment, macro, 'check_sinks', (), False, False, False, context.eval_ctx.autoescape)
    yield '\n'
    def macro():
        t_5 = []
        pass
        t_5.append(
            '    if sm_scale is None:\n        sm_scale = 1.0 / math.sqrt(HEAD_DIM)\n    elif type(sm_scale) is float and 0.0 < sm_scale < math.inf:\n        pass  # the common case, by comparisons only (NaN fails them)\n    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):\n        raise ValueError(f"sm_scale: expected a finite float > 0, got {sm_scale!r}")\n    elif not (math.isfinite(sm_scale) and sm_scale > 0):\n        raise ValueError(f"sm_scale: expected a finite float > 0, got {sm_scale!r}")',
        )
        return concat(t_5)
    context.exported_vars.add('check_sm_scale')
    context.vars['check_sm_scale'] = l_0_check_sm_scale = Macro(environment, macro, 'check_sm_scale', (), False, False, False, context.eval_ctx.autoescape)

blocks = {}
debug_info = '4=12&8=37&15=45&18=50&21=55&34=62&35=64&36=66&37=68&38=70&39=73&40=77&42=84&43=86&44=89&47=94&48=98&50=101&51=105&53=110&54=119&59=124&60=129&67=139&75=152&76=154&78=157&79=161&80=163&82=166&85=171&88=176&111=185&112=189&136=203&137=207&156=221'