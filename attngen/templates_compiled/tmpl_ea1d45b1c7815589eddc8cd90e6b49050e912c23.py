from jinja2.runtime import LoopContext, Macro, Markup, Namespace, TemplateNotFound, TemplateReference, TemplateRuntimeError, Undefined, escape, identity, internalcode, markup_join, missing, str_join
name = '_decode_checks.py.jinja'

def root(context, missing=missing):
    resolve = context.resolve_or_missing
    undefined = environment.undefined
    concat = environment.concat
    cond_expr_undefined = Undefined
    if 0: yield None
    l_0_kv_layout = resolve('kv_layout')
    l_0_sinks = resolve('sinks')
    l_0_common = missing
    try:
        t_1 = environment.filters['trim']
    except KeyError:
        @internalcode
        def t_1(*unused):
            raise TemplateRuntimeError("No filter named 'trim' found.")
    pass
    l_0_common = context.vars['common'] = environment.get_template('_common.py.jinja', '_decode_checks.py.jinja').make_module(context.get_all(), True, {'common': l_0_common})
    context.exported_vars.discard('common')
    yield 'def _check_tensor(name, t, shape, dtype, device):\n    """t must be a tensor of `shape` (None: any size there), dtype and device."""\n    if not isinstance(t, torch.Tensor):\n        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")\n    sizes = zip(shape, t.shape, strict=False)\n    if t.dim() != len(shape) or any(n is not None and n != m for n, m in sizes):\n        expected = "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"\n        raise ValueError(f"{name}: expected shape {expected}, got {list(t.shape)}")\n    if t.dtype != dtype:\n        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")\n    if t.device != device:\n        raise ValueError(f"{name}: expected device {device} (as q), got {t.device}")\n\n\ndef _inputs_ok(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new):\n    """The success path of _check_inputs, by comparisons only; False sends the call to\n    _check_inputs, which names what is wrong (or passes)."""\n    tensor = torch.Tensor\n    if not (type(q) is tensor and type(k_cache) is tensor and type(v_cache) is tensor\n            and type(cache_seqlens) is tensor and q.dim() == 4 and k_cache.dim() == 4):\n        return False\n    cuda, device = q.is_cuda, q.get_device()\n    if not (cuda or (_INTERPRET and q.is_cpu)) or not (\n            (k_cache.is_cuda and v_cache.is_cuda and cache_seqlens.is_cuda) if cuda else\n            (k_cache.is_cpu and v_cache.is_cpu and cache_seqlens.is_cpu)):\n        return False\n    batch, num_q_heads, num_q_tokens, dim = q.shape\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    num_pages, page_size, num_kv_heads, dim_k = k_cache.shape\n    layout_ok = (page_size == PAGE_SIZE\n                 and v_cache.shape == (num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM_V)\n                 and type(block_table) is tensor and block_table.dim() == 2\n                 and block_table.shape[0] == batch and block_table.dtype == torch.int32\n                 and (block_table.is_cuda if cuda else block_table.is_cpu)\n                 and block_table.get_device() == device)\n'
    else:
        pass
        yield '    outer, num_kv_heads, capacity, dim_k = k_cache.shape\n    layout_ok = (outer == batch and block_table is None\n                 and v_cache.shape == (batch, num_kv_heads, capacity, HEAD_DIM_V))\n'
    yield '    if not (layout_ok and dim == HEAD_DIM and dim_k == HEAD_DIM\n            and num_q_tokens <= MAX_QUERY_TOKENS and q.dtype == DTYPE\n            and k_cache.dtype == DTYPE and v_cache.dtype == DTYPE\n            and k_cache.get_device() == device and v_cache.get_device() == device\n            and cache_seqlens.shape == (batch,) and cache_seqlens.dtype == torch.int32\n            and cache_seqlens.get_device() == device and cache_seqlens.is_contiguous()\n            and num_kv_heads != 0 and num_q_heads % num_kv_heads == 0):\n        return False\n    if k_new is None and v_new is None:\n        return True\n    return (type(k_new) is tensor and type(v_new) is tensor and k_new.dim() == 4\n            and k_new.shape[0] == batch and k_new.shape[1] == num_kv_heads\n            and k_new.shape[3] == HEAD_DIM\n            and v_new.shape == (batch, num_kv_heads, k_new.shape[2], HEAD_DIM_V)\n            and k_new.dtype == DTYPE and v_new.dtype == DTYPE\n            and ((k_new.is_cuda and v_new.is_cuda) if cuda else (k_new.is_cpu and v_new.is_cpu))\n            and k_new.get_device() == device and v_new.get_device() == device)\n\n\ndef _in_layout(flash, batch, heads, rows, dim):\n    """A shape [B, H, N, D] in decode()\'s layout, or [B, N, H, D] in flash-attn\'s (flash)."""\n    return (batch, rows, heads, dim) if flash else (batch, heads, rows, dim)\n\n\ndef _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, flash=False):\n    """Every check of _inputs_ok (but on any device), with an error naming what fails; flash:\n    the tensors as decode_flash takes them (q'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) != 'paged'):
        pass
        yield ', the caches'
    yield ' and the new keys in flash-attn\'s\n    [B, N, H, D] layout), named in it."""\n    rows_dim = 1 if flash else 2  # the tokens\' (positions\') dimension\n    if not isinstance(q, torch.Tensor) or q.dim() != 4:\n        shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__\n        layout = "NQ, HQ" if flash else "HQ, NQ"\n        raise ValueError(f"q: expected a tensor [B, {layout}, {HEAD_DIM}], got {shape}")\n    if q.device.type != "cuda" and not (_INTERPRET and q.device.type == "cpu"):\n        raise ValueError(\n            f"q: expected CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {q.device}"\n        )\n    batch, num_q_heads, num_q_tokens = q.shape[0], q.shape[3 - rows_dim], q.shape[rows_dim]\n    _check_tensor("q", q, (None, None, None, HEAD_DIM), DTYPE, q.device)\n    if num_q_tokens > MAX_QUERY_TOKENS:\n        raise ValueError(f"q: expected at most max_query_tokens={MAX_QUERY_TOKENS} query "\n                         f"tokens (dim {rows_dim}), got {num_q_tokens}")\n'
    if ((undefined(name='kv_layout') if l_0_kv_layout is missing else l_0_kv_layout) == 'paged'):
        pass
        yield '    _check_tensor("k_cache", k_cache, (None, PAGE_SIZE, None, HEAD_DIM), DTYPE, q.device)\n    num_pages, _, num_kv_heads, _ = k_cache.shape\n    _check_tensor("v_cache", v_cache, (num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM_V), DTYPE,\n                  q.device)\n    if block_table is None:\n        raise ValueError("block_table: expected int32 [B, max_pages] for a paged cache, got None")\n    _check_tensor("block_table", block_table, (batch, None), torch.int32, q.device)\n'
    else:
        pass
        yield '    _check_tensor("k_cache", k_cache, (batch, None, None, HEAD_DIM), DTYPE, q.device)\n    num_kv_heads, capacity = k_cache.shape[3 - rows_dim], k_cache.shape[rows_dim]\n    _check_tensor("v_cache", v_cache, _in_layout(flash, batch, num_kv_heads, capacity, HEAD_DIM_V),\n                  DTYPE, q.device)\n    if block_table is not None:\n        raise ValueError("block_table: expected None for a contiguous cache, got a "\n                         f"{type(block_table).__name__}")\n'
    yield '    _check_tensor("cache_seqlens", cache_seqlens, (batch,), torch.int32, q.device)\n    if not cache_seqlens.is_contiguous():\n        raise ValueError("cache_seqlens: expected a contiguous tensor (read with stride 1), got "\n                         f"strides {cache_seqlens.stride()}")\n    if num_kv_heads == 0 or num_q_heads % num_kv_heads:\n        raise ValueError("heads: expected q heads a multiple of the cache\'s KV heads, "\n                         f"got {num_q_heads} and {num_kv_heads}")\n    if (k_new is None) != (v_new is None):\n        raise ValueError("k_new, v_new: expected both or neither, got "\n                         f"{type(k_new).__name__} and {type(v_new).__name__}")\n    if k_new is not None:\n        _check_tensor("k_new", k_new, _in_layout(flash, batch, num_kv_heads, None, HEAD_DIM),\n                      DTYPE, q.device)\n        num_new = k_new.shape[rows_dim]\n        _check_tensor("v_new", v_new, _in_layout(flash, batch, num_kv_heads, num_new, HEAD_DIM_V),\n                      DTYPE, q.device)\n\n\ndef _check_alibi(alibi_slopes, num_q_heads, q, batch=None):\n'
    yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_alibi')), '\n'))
    yield '\n'
    if (undefined(name='sinks') if l_0_sinks is missing else l_0_sinks):
        pass
        yield '\n\ndef _check_sinks(sinks, num_q_heads, q):\n'
        yield str(t_1(context.call(environment.getattr((undefined(name='common') if l_0_common is missing else l_0_common), 'check_sinks')), '\n'))
        yield '\n'

blocks = {}
debug_info = '3=20&31=23&70=30&86=34&122=41&123=43&127=46'