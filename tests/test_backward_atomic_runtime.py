"""Which backward path the runtime takes: flash_attn_func's and flash_attn_varlen_func's
`deterministic` (False, flash-attn's default: the atomic-dQ kernels), SDPA's and the
transformers function's torch.are_deterministic_algorithms_enabled(), the eager backward
entry (context parallelism's) deterministic, and a module with no atomic-dQ config running
its deterministic kernels with a warning; last_backward() and backward_runs() record
each, and the gradients of both paths match the float64 reference."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen.build import plan_build, write_build
from attngen.reference.backward import compare_gradients
from attngen.runtime import backward_runs, last_backward, reset_backward_runs
from attngen.runtime.dispatch import Call
from attngen.runtime.launch import run_dense_backward
from attngen.runtime.ops import ATOMIC, DETERMINISTIC, ENV_ATOMIC_DQ
from attngen.runtime.registry import current_registry, load_kernels, use_registry
from attngen.spec import CausalAlign, Mask, specs_from_data
from tests.backward_harness import cu_seqlens, padded_inputs

SPEC = dict(
    name="toy_atomic",
    archs=["sm90"],
    dtype="fp32",
    head_dim=16,
    num_q_heads=4,
    num_kv_heads=2,
    mask="causal",
    causal_align="bottom_right",
    kernels=["prefill", "varlen"],
    backward=True,
)


@pytest.fixture(autouse=True)
def atomic_dq_on(monkeypatch):
    """The atomic path is opt-in (ops.atomic_dq_enabled): these tests route to it."""
    monkeypatch.setenv(ENV_ATOMIC_DQ, "1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = specs_from_data(SPEC)[0]
    folder = tmp_path_factory.mktemp("atomic_kernels")
    write_build(plan_build([spec]), folder)
    saved = current_registry()
    load_kernels(folder, replace=True)
    yield spec
    use_registry(saved)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _flash_grads(spec, deterministic=None):
    """dq, dk, dv (heads first) of flash_attn_func with `deterministic` (None: its default)."""
    q, k, v, dout, _ = padded_inputs(spec, 2, 4, 2, 17, 23, seed=1)
    leaves = _leaves(*(t.transpose(1, 2) for t in (q, k, v)))
    options = {} if deterministic is None else {"deterministic": deterministic}
    out = attngen.flash_attn_func(*leaves, causal=True, **options)
    out.backward(dout.transpose(1, 2))
    return [t.grad.transpose(1, 2) for t in leaves], (q, k, v, dout)


def _prefill_key(spec):
    """The prefill module's key in the registry the fixture loaded."""
    _flash_grads(spec, True)
    return last_backward().key


@pytest.mark.parametrize(
    "deterministic, path", [(None, ATOMIC), (False, ATOMIC), (True, DETERMINISTIC)]
)
def test_flash_attn_func_routes_by_deterministic(trained, deterministic, path):
    reset_backward_runs()
    grads, inputs = _flash_grads(trained, deterministic)
    run = last_backward()
    assert run is not None and run.path == path
    assert run.key.endswith("toy_atomic_prefill_fp32_d16_causal_br_bwd.py")
    assert backward_runs() == {(run.key, path): 1}
    problems = compare_gradients(trained, grads, *inputs)
    assert not problems, "; ".join(problems)


def test_flash_attn_varlen_func_defaults_to_the_atomic_path(trained):
    lengths_q, lengths_k = [9, 0, 17], [12, 3, 17]
    q, k, v, dout, _ = padded_inputs(trained, 1, 4, 2, sum(lengths_q), sum(lengths_k), seed=2)
    packed = [t[0].transpose(0, 1) for t in (q, k, v, dout)]
    paths = []
    for deterministic in (False, True):
        leaves = _leaves(*packed[:3])
        out = attngen.flash_attn_varlen_func(
            *leaves,
            cu_seqlens(lengths_q),
            cu_seqlens(lengths_k),
            max(lengths_q),
            max(lengths_k),
            causal=True,
            deterministic=deterministic,
        )
        out.backward(packed[3])
        paths.append(last_backward().path)
        starts_q, starts_k = cu_seqlens(lengths_q).tolist(), cu_seqlens(lengths_k).tolist()
        for b in range(3):
            rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            seq = [
                t[r].transpose(0, 1)[None]
                for t, r in ((packed[0], rq), (packed[1], rk), (packed[2], rk), (packed[3], rq))
            ]
            grads = [
                t.grad[r].transpose(0, 1)[None]
                for t, r in ((leaves[0], rq), (leaves[1], rk), (leaves[2], rk))
            ]
            problems = compare_gradients(trained, grads, *seq)
            assert not problems, f"sequence {b}: " + "; ".join(problems)
    assert paths == [ATOMIC, DETERMINISTIC]


@pytest.fixture
def deterministic_algorithms():
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(saved)


def _sdpa_backward(spec):
    q, k, v, dout, _ = padded_inputs(spec, 1, 4, 2, 20, 20, seed=3)
    leaves = _leaves(q, k, v)
    attngen.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(dout)
    return last_backward().path


def test_sdpa_follows_torch_deterministic_algorithms(trained):
    assert not torch.are_deterministic_algorithms_enabled()
    assert _sdpa_backward(trained) == ATOMIC


def test_sdpa_is_deterministic_under_use_deterministic_algorithms(
    trained, deterministic_algorithms
):
    assert _sdpa_backward(trained) == DETERMINISTIC


def test_the_eager_backward_entry_is_deterministic(trained):
    """run_dense_backward (context parallelism's per-chunk gradients) keeps the atomics-free
    kernels: its callers sum gradients across chunks and ranks."""
    q, k, v, dout, _ = padded_inputs(trained, 1, 4, 2, 16, 16, seed=4)
    module = current_registry().module(_prefill_key(trained))
    out, lse = module.attention(q, k, v, return_lse=True)
    call = Call(Mask.causal, CausalAlign.bottom_right)
    run_dense_backward("test", dout, q, k, v, out, lse, None, call)
    assert last_backward().path == DETERMINISTIC


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_deterministic_must_be_a_bool(trained, bad):
    q, k, v, _, _ = padded_inputs(trained, 1, 4, 2, 8, 8, seed=5)
    with pytest.raises(ValueError, match="deterministic: expected True or False"):
        attngen.flash_attn_func(
            *(t.transpose(1, 2) for t in (q, k, v)), causal=True, deterministic=bad
        )


def test_a_module_with_no_atomic_config_says_why(trained, monkeypatch):
    key = _prefill_key(trained)
    monkeypatch.setattr(current_registry().module(key), "BWD_DKDV_ATOMIC_CONFIG", None)
    with pytest.warns(UserWarning, match="no atomic-dQ config fits"):
        _flash_grads(trained, False)
    assert last_backward().path == DETERMINISTIC


def test_without_the_opt_in_deterministic_false_runs_the_two_kernels(trained, monkeypatch):
    """The atomic path measured slower on the H200: by default deterministic=False runs the
    two-kernel backward, and last_backward() says why."""
    monkeypatch.delenv(ENV_ATOMIC_DQ)
    grads, inputs = _flash_grads(trained, False)
    run = last_backward()
    assert run.path == DETERMINISTIC and not run.deterministic
    assert ENV_ATOMIC_DQ in run.reason
    problems = compare_gradients(trained, grads, *inputs)
    assert not problems, "; ".join(problems)
