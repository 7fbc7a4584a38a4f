"""The variants of tools/exp_prefill.py: each is the committed sm90 prefill module's source
with a few lines substituted (or, for softmax_overlap, a function of it); that tool's
docstring says what each one measures and what was found."""

from __future__ import annotations

# The committed modules read masked blocks through TMA up to D = 128 (variant "tma_diag" when
# that was measured); "masked_pointers" sends them through masked pointer loads again.
MASKED_POINTERS = [
    (
        "            if USE_TMA and BLOCK_M >= 64:\n                # The copy engine zero-fills",
        "            if False:  # the experiment: masked blocks through pointers\n"
        "                # The copy engine zero-fills",
    )
]
# The committed kernels scale plain scores in the exponent (variant "fma" when that was
# measured); "scaled_first" restores the earlier form, to measure the difference again.
SCALED_FIRST = [
    (
        "        # Note: plain scores stay unscaled; the scale is applied in the row max "
        "and in the\n"
        "        # exponent's FMA (sm_scale > 0, so max(s x qk) = s x max(qk)): one multiply per\n"
        "        # score fewer, 3-6% faster at D = 64 on the H200 (tools/exp_prefill.py, then "
        '"fma").\n'
        "        scores = qk\n",
        "        scores = qk * qk_scale\n",
    ),
    (
        "        m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)\n",
        "        m_new = tl.maximum(m_i, tl.max(scores, 1))\n",
    ),
    (
        "        p = tl.math.exp2(scores * qk_scale - m_ref[:, None])\n",
        "        p = tl.math.exp2(scores - m_ref[:, None])\n",
    ),
]
FAST_EXP = [
    (
        "        p = tl.math.exp2(scores * qk_scale - m_ref[:, None])\n",
        "        p = tl.inline_asm_elementwise(\n"
        '            "ex2.approx.ftz.bf16x2 $0, $1;", "=r,r",\n'
        "            [(scores * qk_scale - m_ref[:, None]).to(tl.bfloat16)],\n"
        "            dtype=tl.bfloat16, is_pure=True, pack=2)\n",
    ),
    (
        "        l_i = l_i * alpha + tl.sum(p, 1)\n",
        "        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)\n",
    ),
]
# The key loop with Triton's warp specialization or loop flattening (both measured on pointer
# loads: nothing gained; the PTX had no setmaxnreg, so no specialization on sm90).
KEY_LOOP = "    for start in tl.range(start_n, end_n, BLOCK_N):\n"
WARP_SPECIALIZE = [(KEY_LOOP, KEY_LOOP.replace("BLOCK_N)", "BLOCK_N, warp_specialize=True)"))]
FLATTEN = [(KEY_LOOP, KEY_LOOP.replace("BLOCK_N)", "BLOCK_N, flatten=True)"))]
OVERLAPPED_INNER = """
@triton.jit
def _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc, v_desc,
                   desc_b, desc_h, start, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
                   WANT_K: tl.constexpr):
    if USE_TMA:
        if WANT_K:
            return tl.trans(k_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_D))
        return v_desc.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, _BLOCK_DV)
    rows = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    if WANT_K:
        dims = tl.arange(0, _BLOCK_D)
        return tl.load(k_base + rows[None, :] * stride_kn + dims[:, None] * stride_kd)
    dims = tl.arange(0, _BLOCK_DV)
    return tl.load(v_base + rows[:, None] * stride_vn + dims[None, :] * stride_vd)


@triton.jit
def _attn_fwd_inner_overlapped(
    acc, l_i, m_i, q, q_pos, first_q_pos, last_q_pos,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc, v_desc, desc_b, desc_h,
    start_n, end_n, seqlen_k, qk_scale, slope_log2,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # Every block here is unmasked and full; m_i may be -inf only before the first block,
    # whose row max is finite, so m_new is finite throughout.
    if end_n > start_n:
        k = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc,
                           v_desc, desc_b, desc_h, start_n, BLOCK_N, USE_TMA, True)
        qk = tl.dot(q, k)
        for start in tl.range(start_n, end_n - BLOCK_N, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            k = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               k_desc, v_desc, desc_b, desc_h, start + BLOCK_N, BLOCK_N,
                               USE_TMA, True)
            qk = tl.dot(q, k)
            acc = acc * alpha[:, None]
            v = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               k_desc, v_desc, desc_b, desc_h, start, BLOCK_N, USE_TMA, False)
            acc = tl.dot(p.to(q.dtype), v, acc)
            m_i = m_new
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_kv_block(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, k_desc,
                           v_desc, desc_b, desc_h, end_n - BLOCK_N, BLOCK_N, USE_TMA, False)
        acc = tl.dot(p.to(q.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


"""
KERNEL_DEF = "@triton.jit\ndef _attn_fwd_kernel("
UNMASKED_CALL = ("    acc, l_i, m_i = _attn_fwd_inner(\n", "MASKED=False,")


def overlapped_source(source: str) -> str | None:
    """The committed source with the unmasked key loop replaced (plain scores only)."""
    if "        scores = qk\n" not in source or source.count(KERNEL_DEF) != 1:
        return None
    head, _, kernel = source.partition(KERNEL_DEF)
    flag = kernel.index(UNMASKED_CALL[1])
    call = kernel.rindex(UNMASKED_CALL[0], 0, flag)
    kernel = (
        kernel[:call]
        + UNMASKED_CALL[0].replace("_inner(", "_inner_overlapped(")
        + kernel[call + len(UNMASKED_CALL[0]) :]
    )
    return head + OVERLAPPED_INNER.lstrip("\n") + KERNEL_DEF + kernel


# FlashAttention-4's conditional rescaling: in unmasked blocks the running max m_i is moved
# (and acc, l_i rescaled) only when some row's max grew by more than 8 (log2 domain), so P
# stays <= 2^8 (exact in bf16's exponent range) and the [BLOCK_M, DV] multiply by alpha is
# skipped in nearly every block after the first. The decision is one tile-wide max.
LAZY_RESCALE = [
    (
        """        p = tl.math.exp2(scores * qk_scale - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(""",
        """        if MASKED:
            p = tl.math.exp2(scores * qk_scale - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        else:
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
            else:
                m_new = m_i
            p = tl.math.exp2(scores * qk_scale - m_new[:, None])
            l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(""",
    )
]
# Causal schedules: the committed order runs the query blocks of one head as adjacent
# programs, heaviest first (they share K/V in L2). lpt_groupG orders G heads at a time
# heaviest block first across the group (longest-processing-time first, for a shorter tail
# at few waves) while the group's K/V still fits in L2; G = 1 is the committed order.
PROGRAM_ORDER = """    m_block = num_m_blocks - 1 - pid % num_m_blocks
    batch_head = pid // num_m_blocks
"""


def lpt_group(size: int) -> list[tuple[str, str]]:
    return [
        (
            PROGRAM_ORDER,
            f"""    group_programs = {size} * num_m_blocks
    group_first = (pid // group_programs) * {size}
    group_heads = tl.minimum({size}, tl.num_programs(0) // num_m_blocks - group_first)
    rank = pid % group_programs
    m_block = num_m_blocks - 1 - rank // group_heads
    batch_head = group_first + rank % group_heads
""",
        )
    ]


MAXNREG = [
    (
        '            num_stages=CONFIG["num_stages"],\n',
        '            num_stages=CONFIG["num_stages"],\n'
        '            **({"maxnreg": CONFIG["maxnreg"]}'
        ' if CONFIG.get("maxnreg") else {}),\n',
    )
]
SUBSTITUTIONS = {
    "pointers": [],
    "tma": [],
    "scaled_first": SCALED_FIRST,
    "masked_pointers": MASKED_POINTERS,
    "fast_exp": FAST_EXP,
    "warp_specialize": WARP_SPECIALIZE,
    "flatten": FLATTEN,
    "softmax_overlap": overlapped_source,
    "lazy_rescale": LAZY_RESCALE,
    "lpt_group4": lpt_group(4),
    "lpt_group16": lpt_group(16),
    "lpt_group1024": lpt_group(1024),
}
INTERPRETABLE = (
    "pointers",
    "tma",
    "scaled_first",
    "masked_pointers",
    "softmax_overlap",
    "lazy_rescale",
    "lpt_group4",
    "lpt_group16",
    "lpt_group1024",
)  # no inline PTX


def variant_source(source: str, name: str) -> str | None:
    """The variant's text, or None where it does not apply (masked_pointers at D = 256)."""
    for old, new in MAXNREG:  # every variant may be launched with a register cap
        source = source.replace(old, new)
    if callable(SUBSTITUTIONS[name]):
        return SUBSTITUTIONS[name](source)
    for old, new in SUBSTITUTIONS[name]:
        if source.count(old) != 1:
            return None
        source = source.replace(old, new)
    return source
