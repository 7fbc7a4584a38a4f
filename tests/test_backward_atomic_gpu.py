"""The atomic-dQ backward (deterministic=False) at real sizes on a CUDA GPU (the H200):
`pytest -m gpu tests/test_backward_atomic_gpu.py`.

The derived configs (BWD_DKDV_ATOMIC_CONFIG: the dK/dV launch's own, None at D 256 on sm90,
where deterministic=False runs the deterministic kernels), compiled kernels with real fp32
atomics, against the float64 golden by the rule (3x for gradients); dQ of the two paths
close; the runtime's flash_attn_func taking the atomic path on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference.backward import compare_gradients
from tests.backward_harness import backward_spec, cu_seqlens, packed_inputs, padded_inputs
from tests.kernel_harness import load_kernel
from tests.test_backward_gpu import CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


def _grads(module, q, k, v, dout, slopes, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module.attention(*leaves, alibi_slopes=slopes, **options)
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1000), (257, 700), (700, 257)])
def test_atomic_gradients_at_real_sizes(name, seqlen_q, seqlen_k):
    fields = CASES[name]
    spec = backward_spec(**fields)
    module = load_kernel(spec)
    if fields["head_dim"] == 256:  # no atomic dK launch fits sm90's shared memory there
        assert module.BWD_DKDV_ATOMIC_CONFIG is None
    if module.BWD_DKDV_ATOMIC_CONFIG is None:
        pytest.skip("no atomic dK/dV config fits this module (fp32 and D 256 tiles)")
    q, k, v, dout, slopes = padded_inputs(
        spec, 2, fields["num_q_heads"], fields["num_kv_heads"], seqlen_q, seqlen_k, seed=1
    )
    cuda = [t.cuda() for t in (q, k, v, dout)]
    grads = _grads(module, *cuda, None if slopes is None else slopes.cuda(), deterministic=False)
    problems = compare_gradients(spec, [g.cpu() for g in grads], q, k, v, dout, alibi_slopes=slopes)
    assert not problems, "; ".join(problems)


def test_atomic_dq_is_close_to_the_deterministic_dq_with_dropout():
    """Llama-3-8B-shaped heads (32:8, D 128, bf16) at N 2048 with dropout: dK and dV of the
    two paths agree to bf16 rounding, dQ (the atomic sum in another order) too."""
    spec = backward_spec(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, dropout=True)
    module = load_kernel(spec)
    inputs = [t.cuda() for t in padded_inputs(spec, 2, 32, 8, 2048, 2048, seed=2)[:4]]
    state = torch.tensor([5, 0], dtype=torch.int64, device="cuda")
    runs = [
        _grads(module, *inputs, None, dropout_p=0.1, rng_state=state, deterministic=det)
        for det in (True, False)
    ]
    for name, a, b in zip(("dq", "dk", "dv"), *runs, strict=True):
        scale = a.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= 2**-7 * scale, name
        assert torch.isfinite(b).all(), name


def test_atomic_varlen_gradients_with_an_empty_sequence():
    spec = backward_spec(dtype="bf16", head_dim=128, num_q_heads=8, num_kv_heads=2)
    module = load_kernel(spec, kind="varlen")
    lengths = [700, 0, 257]
    q, k, v, dout, _ = packed_inputs(spec, lengths, lengths, 8, 2, seed=4, pad=0)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    cu = cu_seqlens(lengths).cuda()
    out = module.attention_varlen(*leaves, cu, cu, 700, 700, deterministic=False)
    out.backward(dout.cuda())
    starts = cu_seqlens(lengths).tolist()
    for b in (0, 2):
        rows = slice(starts[b], starts[b + 1])
        seq = [t[rows].transpose(0, 1)[None] for t in (q, k, v, dout)]
        grads = [t.grad[rows].cpu().transpose(0, 1)[None] for t in leaves]
        problems = compare_gradients(spec, grads, *seq)
        assert not problems, f"sequence {b}: " + "; ".join(problems)


def test_flash_attn_func_takes_the_atomic_path_on_the_gpu(tmp_path):
    import attngen
    from attngen.build import plan_build, write_build
    from attngen.runtime import last_backward
    from attngen.runtime.registry import current_registry, load_kernels, use_registry

    spec = backward_spec(name="gpu_atomic", dtype="bf16", head_dim=128)
    write_build(plan_build([spec]), tmp_path)
    saved = current_registry()
    try:
        load_kernels(tmp_path, replace=True)
        q, k, v, dout, _ = padded_inputs(spec, 2, 4, 2, 1000, 1000, seed=5)
        paths = {}
        for deterministic in (False, True):
            leaves = [t.cuda().transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
            out = attngen.flash_attn_func(*leaves, causal=True, deterministic=deterministic)
            out.backward(dout.cuda().transpose(1, 2))
            torch.cuda.synchronize()
            paths[deterministic] = last_backward().path
            grads = [t.grad.transpose(1, 2).cpu() for t in leaves]
            problems = compare_gradients(spec, grads, q, k, v, dout)
            assert not problems, f"deterministic={deterministic}: " + "; ".join(problems)
    finally:
        use_registry(saved)
    assert paths == {False: "atomic", True: "deterministic"}
