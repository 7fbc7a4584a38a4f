"""Dispatch never picks a kernel with another mask, never from a replaced registry, and keeps
its records per thread: regression tests with the toy kernels (tests/runtime_harness.py)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import attngen
from attngen.reference import compare_to_reference
from attngen.runtime import dispatch
from attngen.runtime import registry as registry_module
from attngen.runtime.registry import Registry, current_registry, load_kernels, use_registry
from attngen.runtime.selection import INTERPRETER, Need
from attngen.spec import CausalAlign, Dtype, KernelKind, Mask
from tests.kernel_harness import make_spec
from tests.runtime_harness import build_fake_decode, build_folder
from tests.test_runtime import _cache_case, qkv, rand
from tests.test_varlen_properties import cu_seqlens

WINDOW_SPEC = make_spec(
    dtype="fp16",
    head_dim=32,
    num_q_heads=2,
    num_kv_heads=2,
    mask="sliding_window",
    window_left=3,
    window_right=0,
    softcap=5.0,
)


# ------------------------------------------------------------ lengths the tensors guarantee


def test_a_low_max_seqlen_claim_never_selects_a_window_kernel(toy_kernels):
    """toy_win's window (3, 0) equals causal only for sequences of at most 4 tokens. A causal
    call claiming max_seqlen 4 for a 9-token sequence must not run on it (it would hide keys
    4 and more back): the packed length, 9, is what the tensors guarantee."""
    q, k, v = (rand(9, 2, 32, dtype=torch.float16, seed=s) for s in range(3))
    cu = cu_seqlens([9])
    with pytest.raises(attngen.NoKernelError, match=r"mask: needs causal"):
        attngen.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, softcap=5.0)
    # Sequences that really are that short still run on it, whatever max_seqlen says.
    short = [t[:4] for t in (q, k, v)]
    cu = cu_seqlens([4])
    out, lse, _ = attngen.flash_attn_varlen_func(
        *short, cu, cu, 4, 4, causal=True, softcap=5.0, return_attn_probs=True
    )
    assert attngen.last_dispatch().module == "sm90/toy_win_varlen_fp16_d32_win3x0_br_cap5"
    assert not compare_to_reference(
        WINDOW_SPEC, out.transpose(0, 1)[None], lse[None], *(t.transpose(0, 1)[None] for t in short)
    )


def _causal_need(seqlen_q: int, seqlen_k: int, **fields) -> Need:
    """A causal (bottom-right) prefill Need on the interpreter: toy_win's fields unless given."""
    base = dict(
        kind=KernelKind.prefill,
        dtype=Dtype.fp16,
        head_dim=32,
        head_dim_v=32,
        mask=Mask.causal,
        causal_align=CausalAlign.bottom_right,
        window=None,
        softcap=5.0,
        alibi=False,
        arch=INTERPRETER,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        same_lengths=seqlen_q == seqlen_k,
    )
    return Need(**{**base, **fields})


def test_a_cached_choice_never_serves_a_length_its_module_does_not(toy_kernels):
    """The dispatch cache keys a Need's key length by its class among the modules' windows:
    toy_win (window (3, 0), equal to causal up to 4 tokens) chosen for a 4-token causal call
    must not serve a 5-token one from the cache (refused, as without the cache), while every
    key length up to 4 reuses the choice, recorded with the call's own lengths."""
    chosen = dispatch.choose("test", _causal_need(1, 4))
    assert chosen.module == "sm90/toy_win_prefill_fp16_d32_win3x0_br_cap5"
    assert chosen.need.seqlen_k == 4
    for seqlen_k in (3, 2, 4):
        again = dispatch.choose("test", _causal_need(1, seqlen_k))
        assert again.key == chosen.key and again.need.seqlen_k == seqlen_k
    with pytest.raises(attngen.NoKernelError, match=r"mask: needs causal"):
        dispatch.choose("test", _causal_need(1, 5))
    with pytest.raises(attngen.NoKernelError, match=r"mask: needs causal"):
        dispatch.choose("test", _causal_need(5, 5))


def test_a_growing_key_length_selects_once_per_length_class(toy_kernels, monkeypatch):
    """A decode loop's key count grows every step: the scan of the modules runs once for all
    lengths of one class (here: past every window of the toy kernels), not once per step."""
    scans = []
    best_entry = dispatch.best_entry
    monkeypatch.setattr(dispatch, "best_entry", lambda *a: scans.append(1) or best_entry(*a))
    need = _causal_need(1, 64, dtype=Dtype.fp32, head_dim=16, head_dim_v=16, softcap=0.0)
    first = dispatch.choose("test", need)
    for seqlen_k in range(65, 129):
        got = dispatch.choose("test", need._replace(seqlen_k=seqlen_k))
        assert got.key == first.key and got.need.seqlen_k == seqlen_k
    assert len(scans) == 1


def test_one_query_token_without_causal_runs_on_the_causal_decode_kernel(toy_folder, tmp_path):
    """flash_attn_with_kvcache's default causal=False with one new token: that token sits at
    the end of the sequence, so causal (bottom-right) hides nothing from it."""
    saved = current_registry()
    try:
        load_kernels(toy_folder, build_fake_decode(tmp_path / "decode"), replace=True)
        q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case()
        q, k_new, v_new = q[:, :1], k_new[:, :1], v_new[:, :1]
        out, lse = attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, return_softmax_lse=True
        )
        assert attngen.last_dispatch().module == "sm90/toy_decode"
        spec = make_spec(dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2, mask="none")
        for b, n in enumerate(seqlens.tolist()):
            keys, values = (c[b, : n + 1].transpose(0, 1)[None] for c in (k_cache, v_cache))
            assert not compare_to_reference(
                spec,
                out[b : b + 1].transpose(1, 2),
                lse[b : b + 1],
                q[b : b + 1].transpose(1, 2),
                keys,
                values,
            )
        # Two query tokens: the first one would see the second's key without causal.
        q2, k_cache, v_cache, *_ = _cache_case()
        with pytest.raises(attngen.NoKernelError, match="mask: needs none"):
            attngen.flash_attn_with_kvcache(q2, k_cache, v_cache, cache_seqlens=seqlens)
    finally:
        use_registry(saved)


def test_one_query_token_without_causal_on_the_varlen_route(toy_kernels):
    q, k_cache, v_cache, _, _, seqlens = _cache_case()
    out = attngen.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=seqlens)
    assert attngen.last_dispatch().module == "sm90/toy_varlen_fp32_d16_causal_br"
    expected = attngen.flash_attn_with_kvcache(
        q[:, :1], k_cache, v_cache, cache_seqlens=seqlens, causal=True
    )
    assert torch.equal(out, expected)


# ------------------------------------------------------------------- registry replacement


class _SwapDuringScan(dict):
    """A spec dict whose first read runs `swap` (another thread's load_kernels and call)."""

    def __init__(self, data, swap):
        super().__init__(data)
        self.swap = swap

    def get(self, *args):
        swap, self.swap = self.swap, None
        if swap is not None:
            swap()
        return super().get(*args)


def test_a_thread_on_the_replaced_registry_never_fills_the_new_ones_cache(toy_folder, tmp_path):
    """Thread A scans the old registry; meanwhile thread B loads another folder and dispatches
    the same kind of call. A's scan result must not end up serving later calls: they run the
    new folder's module."""
    other = build_folder(
        tmp_path / "other",
        [
            dict(
                name="other",
                dtype="fp32",
                head_dim=16,
                num_q_heads=4,
                num_kv_heads=2,
                mask="causal",
                causal_align="bottom_right",
                kernels=["prefill"],
            )
        ],
    )
    saved = registry_module._current
    need = _causal_need(8, 8, dtype=Dtype.fp32, head_dim=16, head_dim_v=16, softcap=0.0)
    chosen = {}

    def thread_b():
        load_kernels(other, replace=True)
        chosen["b"] = dispatch.select("test", need).module

    def swap():
        worker = threading.Thread(target=thread_b)
        worker.start()
        worker.join()

    try:
        old = load_kernels(toy_folder, replace=True)
        entries = [
            replace(e, spec=_SwapDuringScan(e.spec, swap)) if i == 0 else e
            for i, e in enumerate(old.entries)
        ]
        registry_module._current = Registry(old.folders, entries)
        chosen["a"] = dispatch.select("test", need).module  # thread B runs inside this scan
        chosen["later"] = dispatch.select("test", need).module
    finally:
        registry_module._current = saved
    assert chosen == {
        "a": "sm90/toy_prefill_fp32_d16_causal_br",
        "b": "sm90/other_prefill_fp32_d16_causal_br",
        "later": "sm90/other_prefill_fp32_d16_causal_br",
    }


def test_a_key_from_a_replaced_registry_is_refused(toy_kernels, tmp_path):
    q, k, v = qkv(1, 4, 4)
    attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    key = attngen.last_dispatch().key
    load_kernels(
        build_folder(
            tmp_path / "other",
            [
                dict(
                    name="other",
                    dtype="fp32",
                    head_dim=16,
                    num_q_heads=4,
                    num_kv_heads=2,
                    mask="causal",
                    causal_align="bottom_right",
                    kernels=["prefill"],
                )
            ],
        ),
        replace=True,
    )
    with pytest.raises(attngen.runtime.RegistryError, match="not among the kernels loaded now"):
        attngen.runtime.ops.prefill(key, q, k, v, 0.25, None, False)


# ----------------------------------------------------------------- per-thread, nested logs


def test_dispatch_logs_nest(toy_kernels):
    q, k, v = qkv(1, 4, 4)

    def call():
        attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with attngen.dispatch_log() as outer:
        with attngen.dispatch_log() as inner:
            pass  # both logs are empty (equal) here: closing the inner one keeps the outer
        call()
        with attngen.dispatch_log() as inner:
            call()
        call()
    assert len(outer) == 3 and inner == [outer[1]] and inner[0] is outer[1]
    call()
    assert len(outer) == 3  # closed


def test_dispatch_records_are_per_thread(toy_kernels):
    """Two threads, each inside its own log, call alternately: each log and each thread's
    last_dispatch() hold only that thread's calls."""
    q, k, v = qkv(1, 4, 4)
    steps = [threading.Semaphore(0), threading.Semaphore(0)]
    seen = {}

    def worker(me: int, api: str):
        with attngen.dispatch_log() as log:
            for _ in range(2):
                steps[me].acquire()
                if api == "sdpa":
                    attngen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    attngen.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
                steps[1 - me].release()
        seen[api] = ([d.api for d in log], attngen.last_dispatch().api)

    threads = [
        threading.Thread(target=worker, args=(0, "sdpa")),
        threading.Thread(target=worker, args=(1, "flash")),
    ]
    for t in threads:
        t.start()
    steps[0].release()
    for t in threads:
        t.join()
    assert seen == {
        "sdpa": (["scaled_dot_product_attention"] * 2, "scaled_dot_product_attention"),
        "flash": (["flash_attn_func"] * 2, "flash_attn_func"),
    }
