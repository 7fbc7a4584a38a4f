"""The trace cache of attngen.flex_attention (attngen/runtime/flex/cache.py): a repeated call
does not trace again; a changed constant, dtype or aliasing does; a captured tensor's values
(and a new tensor of the same kind) are read at run time without a new trace; what the
snapshot cannot compare is traced on every call. And flex_attention under torch.compile: a
clean graph break."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attngen
from attngen.runtime.flex import cache
from tests.ondemand_harness import on_demand  # noqa: F401 - a fixture


@pytest.fixture()
def traces(monkeypatch):
    """The number of functions traced so far (a list: [count])."""
    count = [0]
    real = cache.trace

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "trace", counted)
    monkeypatch.setattr(cache, "_traces", type(cache._traces)())
    monkeypatch.setattr(cache, "_seen", {})
    return count


def window(size):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < size)

    return mask


def reading(table):
    def mask(b, h, q_idx, kv_idx):
        return table[b, q_idx] == table[b, kv_idx]

    return mask


def test_a_repeated_function_is_traced_once(traces) -> None:
    mask = window(4)
    first = cache.traced(None, mask)
    assert cache.traced(None, mask)[2] is first[2] and traces[0] == 1
    assert cache.traced(None, window(4))[2] is first[2] and traces[0] == 1  # a new closure
    assert "8" in str(cache.traced(None, window(8))[2]) and traces[0] == 2  # a new constant
    assert "-4.0" in str(cache.traced(None, window(-4.0))[2]) and traces[0] == 3


def test_tensors_are_bound_by_kind_not_identity(traces) -> None:
    ids = torch.tensor([[0, 0, 1]])
    tree = cache.traced(None, reading(ids))[2]
    other = torch.tensor([[1, 1, 1]])
    again, capture = cache.traced(None, reading(other))[2:]
    assert again is tree and traces[0] == 1
    assert capture.values()["table"] is other  # the call's tensor, read at run time
    assert cache.traced(None, reading(ids.int()))[2] is not tree and traces[0] == 2  # dtype
    with pytest.raises(attngen.TraceError, match="indexed with 2 indices"):
        cache.traced(None, reading(ids[0]))  # ndim: traced again, and refused

    def pair(a, b):
        return lambda bb, h, q_idx, kv_idx: a[q_idx] == b[kv_idx]

    one, two = torch.arange(3), torch.arange(3)
    assert len(cache.traced(None, pair(one, one))[3].declarations()) == 1
    assert len(cache.traced(None, pair(one, two))[3].declarations()) == 2  # traced again


def test_what_the_snapshot_cannot_compare_is_traced_every_call(traces) -> None:
    limit = torch.tensor(5)

    def item(b, h, q_idx, kv_idx):
        return kv_idx < limit.item()  # a value read at trace time

    class Window:
        size = 3

        def mask(self, b, h, q_idx, kv_idx):
            return q_idx - kv_idx < self.size

    settings = {"size": 2}

    def from_dict(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < settings["size"]

    for fn in (item, Window().mask, from_dict):
        before = traces[0]
        cache.traced(None, fn)
        cache.traced(None, fn)
        assert traces[0] == before + 2, fn
    limit.fill_(7)
    assert "7" in str(cache.traced(None, item)[2])
    settings["size"] = 9
    assert "9" in str(cache.traced(None, from_dict)[2])


def test_a_changed_value_is_read_at_run_time(on_demand, traces) -> None:  # noqa: F811
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    docs = torch.tensor([[0] * 10 + [1] * 14])
    mask = reading(docs)
    for step in range(2):
        block = attngen.create_block_mask(mask, 1, None, 24, 24, "cpu")
        out = attngen.flex_attention(q, k, v, block_mask=block)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = torch_flex(q, k, v, block_mask=torch_block_mask(mask, 1, None, 24, 24, "cpu"))
        # Note: fp32 on both sides, summation order alone differs (RELIABILITY.md's fp32 floor)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        docs[0, 4:] = 1 + step  # in place: the same tensor, new values
    assert traces[0] == 1


def test_flex_attention_is_a_graph_break_under_torch_compile(on_demand) -> None:  # noqa: F811
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    block = attngen.create_block_mask(window(5), 1, None, 16, 16, "cpu")

    def step(q, k, v):
        return attngen.flex_attention(q * 2.0, k, v, block_mask=block) + 1.0

    want = step(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(step, backend="eager")(q, k, v)
    assert torch.equal(got, want)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="flex_attention traces its score_mod"):
        torch.compile(step, backend="eager", fullgraph=True)(q, k, v)


LIMIT = 3


def limited(b, h, q_idx, kv_idx):
    return kv_idx < LIMIT


def near(b, h, q_idx, kv_idx):
    return abs(q_idx - kv_idx) < 3


def settled(score_mod, mask_mod=None):
    """The tree of two calls, the second from the identity path (its entry kept)."""
    cache.traced(score_mod, mask_mod)
    score, keep, mask, capture = cache.traced(score_mod, mask_mod)
    assert (id(score_mod), id(mask_mod)) in cache._seen
    return str(mask if score_mod is None else score), capture


def test_what_a_snapshot_read_is_checked_on_every_call(traces, monkeypatch) -> None:
    """The last snapshot of a pair of functions serves while what it read is the same
    (cache._same): a nonlocal, a global, a function's code or defaults, a global that shadows
    a builtin, a list changed in place each trace again; the same call does not."""

    def adjustable():
        size = 4

        def mask(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < size

        def grow(n):
            nonlocal size
            size = n

        return mask, grow

    mask, grow = adjustable()
    assert "4" in settled(None, mask)[0] and traces[0] == 1
    grow(9)
    assert "9" in settled(None, mask)[0] and traces[0] == 2
    assert "3" in settled(None, limited)[0] and traces[0] == 3
    monkeypatch.setitem(globals(), "LIMIT", 5)
    assert "5" in settled(None, limited)[0] and traces[0] == 4
    assert "abs" in settled(None, near)[0] and traces[0] == 5
    monkeypatch.setitem(globals(), "abs", lambda x: x)  # a global now shadows the builtin
    assert "abs" not in settled(None, near)[0] and traces[0] == 6

    def fixed(b, h, q_idx, kv_idx, size=3):
        return q_idx - kv_idx < size

    assert "3" in settled(None, fixed)[0]
    fixed.__defaults__ = (7,)
    assert "7" in settled(None, fixed)[0] and traces[0] == 8
    fixed.__code__ = limited.__code__
    assert "5" in settled(None, fixed)[0] and traces[0] == 9  # limited's code: LIMIT
    sizes = [2]

    def listed(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < sizes[0]

    assert "2" in str(cache.traced(None, listed)[2])
    sizes[0] = 6  # a list is snapshot on every call (no identity path)
    assert "6" in str(cache.traced(None, listed)[2]) and traces[0] == 11


def test_captured_tensors_are_checked_on_every_call(traces) -> None:
    """The last snapshot's tensors: requires_grad set in place, grad mode and aliasing undone
    by a rebound variable each trace again (a declaration trainable or not, two tensors)."""
    bias = torch.randn(4)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    assert not settled(biased)[1].declarations()[0].trainable and traces[0] == 1
    bias.requires_grad_()
    assert settled(biased)[1].declarations()[0].trainable and traces[0] == 2
    with torch.no_grad():
        assert not settled(biased)[1].declarations()[0].trainable and traces[0] == 3

    def aliasing():
        a = c = torch.arange(3)

        def mask(bb, h, q_idx, kv_idx):
            return a[q_idx] == c[kv_idx]

        def split():
            nonlocal c
            c = torch.arange(3)

        return mask, split

    mask, split = aliasing()
    assert len(settled(None, mask)[1].declarations()) == 1 and traces[0] == 4
    split()
    assert len(settled(None, mask)[1].declarations()) == 2 and traces[0] == 5


def test_a_snapshot_goes_with_its_functions(traces) -> None:
    """The identity path holds its functions weakly: a function that dies takes its entry
    (and what the entry held: its captured tensors) with it."""
    import gc
    import weakref

    table = torch.zeros(1, 8, dtype=torch.int64)
    mask = reading(table)
    settled(None, mask)
    pair, held = (id(None), id(mask)), weakref.ref(table)
    del mask, table
    gc.collect()
    assert pair not in cache._seen and held() is None


def test_a_repeated_call_takes_its_route_from_the_route_cache(on_demand, monkeypatch) -> None:  # noqa: F811
    """A call served before runs the module kept in the registry's route cache, asking no
    Need (need_for) and no settings; another length, or new settings (configure reloads
    the registry), take the full path again."""
    from attngen.runtime import last_dispatch
    from attngen.runtime.flex import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    block = attngen.create_block_mask(window(5), 1, None, 24, 24, "cpu")
    first = attngen.flex_attention(q, k, v, block_mask=block)
    assert last_dispatch().built
    attngen.flex_attention(q, k, v, block_mask=block)  # kept in the route cache now

    def asked(*args, **kwargs):
        raise AssertionError("need_for asked")

    monkeypatch.setattr(attention, "need_for", asked)
    again = attngen.flex_attention(q * 1, k, v, block_mask=block)
    assert torch.equal(again, first) and "built on demand earlier" in last_dispatch().reason
    assert not last_dispatch().built and "a built-in mask" in last_dispatch().reason
    shorter = [t[:, :, :16] for t in (q, k, v)]
    short = attngen.create_block_mask(window(5), 1, None, 16, 16, "cpu")
    with pytest.raises(AssertionError, match="need_for asked"):
        attngen.flex_attention(*shorter, block_mask=short)
    attngen.configure(cache_dir=on_demand.parent / "other")
    with pytest.raises(AssertionError, match="need_for asked"):
        attngen.flex_attention(q, k, v, block_mask=block)
