"""The cached launcher (on a GPU) calls a compiled kernel with its arguments by position:
tensors, ints, the tail, then the constexprs, which must be the kernel's last parameters in
their order. A GPU checks that on a specialization's first launch and refuses ("its
parameters are not the launch's groups in order"); the interpreter never gets there. Here
every launch of a decode module (the plain step, the append, the split kernel with fused
rotary, the absorbed MLA kernel with V_FROM_K, the combine) is held to the same order on the
CPU, so a template that names a constexpr out of place fails in CI rather than on the H200."""

from __future__ import annotations

import pytest

from tests.decode_harness import load_decode, make_cache, make_decode_spec, make_queries, run_decode
from tests.test_decode_rotary import capacity_of, rotary_tables
from tests.test_mla_decode import latent_cache, mla_spec, run


@pytest.fixture
def launches(monkeypatch):
    """Patches a module's _launch so that each launch's groups are checked, then run."""
    seen: list[str] = []

    def watch(module):
        original = module._launch

        def checked(kernel, grid, device, tensors, ints, tail, constexprs, options):
            names = list(kernel.arg_names)
            positional = len(tensors) + len(ints) + len(tail)
            assert len(names) == positional + len(constexprs), (names, positional, constexprs)
            assert names[positional:] == list(constexprs), (names[positional:], constexprs)
            seen.append(names[0] if not hasattr(kernel, "fn") else kernel.fn.__name__)
            return original(kernel, grid, device, tensors, ints, tail, constexprs, options)

        monkeypatch.setattr(module, "_launch", checked)
        return module

    watch.seen = seen  # type: ignore[attr-defined]
    return watch


@pytest.mark.parametrize("values", ["latent", "separate"])
def test_the_absorbed_mla_launches_name_their_groups_in_order(launches, values):
    spec = mla_spec("paged")
    module = launches(load_decode(spec))
    cache = (
        latent_cache(spec, [70, 9], seed=1)
        if values == "latent"
        else make_cache(spec, [70, 9], seed=1)
    )
    q, _, _, _ = make_queries(spec, 2, 1, seed=2)
    run(module, cache, q, 2)
    assert {"_decode_split_kernel", "_decode_combine_kernel"} <= set(launches.seen)


@pytest.mark.parametrize("rotary", [False, True])
def test_decode_launches_with_and_without_rotary_name_their_groups_in_order(launches, rotary):
    spec = make_decode_spec("paged", 4, mask="causal", dtype="fp16", head_dim=32,
                            max_query_tokens=4)  # fmt: skip
    module = launches(load_decode(spec, 16))
    cache = make_cache(spec, [5, 2], seed=3, room=3)
    q, k_new, v_new, _ = make_queries(spec, 2, 3, seed=3, num_new=3)
    extra = {}
    if rotary:
        cos, sin = rotary_tables(capacity_of(cache), 8, q.dtype, seed=4)
        extra = dict(rotary_cos=cos, rotary_sin=sin)
    run_decode(module, cache, q, k_new, v_new, **extra)
    assert {"_append_kernel", "_decode_split_kernel"} <= set(launches.seen)
