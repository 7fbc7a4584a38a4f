"""Runtime test setup: a folder of toy generated kernels, loaded as the registry in use.

The kernels are built by the real build path (`plan_build`, `write_build`) from a few small
specs chosen so that every dispatch rule has a module to pick or to reject; the registry in
use is restored afterwards, so other tests keep the default (the repository's generated/).
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest

from attngen.build import plan_build, write_build
from attngen.host import template_hash
from attngen.runtime import registry as registry_module
from attngen.runtime.registry import load_kernels
from attngen.spec import specs_from_data
from attngen.spec.names import __version__

TOY_SPECS = [
    # causal bottom-right fp32, prefill and varlen (Llama-like, GQA 2:1)
    dict(
        name="toy",
        dtype="fp32",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=2,
        mask="causal",
        causal_align="bottom_right",
        kernels=["prefill", "varlen"],
    ),
    # SDPA's top-left causal, for Nq != Nk
    dict(
        name="toy_tl",
        dtype="fp32",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=2,
        mask="causal",
        causal_align="top_left",
        kernels=["prefill"],
    ),
    # a window with softcap in fp16, head dim 32
    dict(
        name="toy_win",
        dtype="fp16",
        head_dim=32,
        num_q_heads=2,
        num_kv_heads=2,
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=3,
        window_right=0,
        softcap=5.0,
        kernels=["prefill", "varlen"],
    ),
    # no mask with ALiBi
    dict(
        name="toy_alibi",
        dtype="fp32",
        head_dim=16,
        num_q_heads=4,
        num_kv_heads=4,
        mask="none",
        alibi=True,
        kernels=["prefill"],
    ),
]


def build_folder(folder: Path, specs: list[dict]) -> Path:
    loaded = [s for data in specs for s in specs_from_data({"archs": ["sm90"], **data})]
    write_build(plan_build(loaded), folder)
    return folder


@pytest.fixture(scope="session")
def toy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_folder(tmp_path_factory.mktemp("toy_kernels"), TOY_SPECS)


@pytest.fixture()
def toy_kernels(toy_folder: Path):
    """The toy kernels as the registry in use, for one test."""
    saved = registry_module._current
    yield load_kernels(toy_folder, replace=True)
    registry_module._current = saved


# Stand-in modules honouring the entry-point contracts (docs/generated_modules.md), in torch
# (test only), for routes no toy kernel exercises: the decode kind with its in-place append,
# and entry points that take `out=` (ACCEPTS_OUT), which today's templates do not have yet.
# Each records the data_ptr of every out= it is given (None when none was) in WROTE.
_STAND_IN = textwrap.dedent('''\
    {header}
    """A stand-in {kind} module honouring the {kind} contract, in torch (test only)."""
    import math

    import torch

    HEAD_DIM = 16
    HEAD_DIM_V = 16
    DTYPE = torch.float32
    MASK = "causal"
    CAUSAL_ALIGN = "bottom_right"
    SOFTCAP = 0.0
    ALIBI = False
    KV_LAYOUT = "contiguous"
    PAGE_SIZE = 0
    MAX_QUERY_TOKENS = 4
    ACCEPTS_OUT = {accepts_out}
    CALLS = []
    WROTE = []


    def _attend(q, k, v, lengths, sm_scale):
        """Causal bottom-right attention of q [HQ, M, D] over the first `lengths` keys."""
        group = q.shape[0] // k.shape[0]
        k = k[:, :lengths].repeat_interleave(group, 0).float()
        v = v[:, :lengths].repeat_interleave(group, 0).float()
        s = q.float() @ k.transpose(-1, -2) * (sm_scale or 1 / math.sqrt(q.shape[-1]))
        i = torch.arange(q.shape[1])[:, None] + lengths - q.shape[1]
        s = s.masked_fill(torch.arange(lengths)[None, :] > i, float("-inf"))
        lse = torch.logsumexp(s, -1)
        return torch.nan_to_num(torch.softmax(s, -1)) @ v, lse


    def _finish(result, lse, out, return_lse):
        WROTE.append(None if out is None else out.data_ptr())
        out = result if out is None else out.copy_(result)
        return (out, lse) if return_lse else out


    def attention(q, k, v, *, sm_scale=None, alibi_slopes=None, return_lse=False, out=None):
        CALLS.append(q.shape)
        pairs = [_attend(q[b], k[b], v[b], k.shape[2], sm_scale) for b in range(q.shape[0])]
        result = torch.stack([o for o, _ in pairs]).to(q.dtype)
        return _finish(result, torch.stack([lse for _, lse in pairs]), out, return_lse)


    def decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None,
               v_new=None, sm_scale=None, alibi_slopes=None, return_lse=False, out=None,
               num_splits=0):
        CALLS.append(q.shape)
        new = 0 if k_new is None else k_new.shape[2]
        for b in range(q.shape[0] if new else 0):
            start = int(cache_seqlens[b])
            k_cache[b, :, start:start + new] = k_new[b]
            v_cache[b, :, start:start + new] = v_new[b]
        pairs = [_attend(q[b], k_cache[b], v_cache[b], int(cache_seqlens[b]) + new, sm_scale)
                 for b in range(q.shape[0])]
        result = torch.stack([o for o, _ in pairs]).to(q.dtype)
        return _finish(result, torch.stack([lse for _, lse in pairs]), out, return_lse)
''')
# The decode kind's flash-layout entry points (docs/generated_modules.md), over decode().
_DECODE_FLASH = textwrap.dedent("""\


    ACCEPTS_ROTARY = False


    def decode_flash_out(q, *args, out=None, return_lse=False, **kw):
        if out is None and q.shape[2] == 1:  # [B, HQ, 1, DV] is [B, 1, HQ, DV] already
            result, lse = decode(q, *args, return_lse=True, **kw)
            out = result.transpose(1, 2)
        else:
            if out is None:
                out = torch.empty(q.shape[0], q.shape[2], q.shape[1], HEAD_DIM_V, dtype=q.dtype)
            lse = decode(q, *args, out=out.transpose(1, 2), return_lse=True, **kw)[1]
        return (out, lse) if return_lse else out


    def decode_flash(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, **kw):
        def t(x):
            return None if x is None else x.transpose(1, 2)

        return decode_flash_out(t(q), t(k_cache), t(v_cache), cache_seqlens, k_new=t(k_new),
                                v_new=t(v_new), **kw)
""")


# The prefill kind's flash-layout entry points (docs/generated_modules.md), over attention():
# every module of the running attngen has them (the registry's header check).
_PREFILL_FLASH = textwrap.dedent("""\


    def attention_flash_out(q, k, v, *, out=None, return_lse=False, **kw):
        if out is None and q.shape[2] == 1:  # [B, HQ, 1, DV] is [B, 1, HQ, DV] already
            result, lse = attention(q, k, v, return_lse=True, **kw)
            out = result.transpose(1, 2)
        else:
            if out is None:
                out = torch.empty(q.shape[0], q.shape[2], q.shape[1], HEAD_DIM_V, dtype=q.dtype)
            lse = attention(q, k, v, out=out.transpose(1, 2), return_lse=True, **kw)[1]
        return (out, lse) if return_lse else out


    def attention_flash(q, k, v, **kw):
        return attention_flash_out(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
""")


def stand_in_source(kind: str, accepts_out: bool) -> str:
    """The stand-in module of `kind`, headed as the running attngen's templates head theirs."""
    template = "decode.py.jinja" if kind == "decode" else "prefill.py.jinja"
    header = f"# Generated by attngen {__version__} from template {template} "
    header += f"({template_hash(template)})."
    source = _STAND_IN.format(header=header, kind=kind, accepts_out=accepts_out)
    return source + (_DECODE_FLASH if kind == "decode" else _PREFILL_FLASH)


def build_stand_ins(folder: Path, kinds=("decode",), accepts_out: bool = False) -> Path:
    """A folder of stand-in modules (fp32, d16, causal bottom-right, 4 q / 2 kv heads), one
    per kind, named toy_<kind> (toy_<kind>_out with accepts_out); decode's has a contiguous
    cache and up to 4 query tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sm90").mkdir(exist_ok=True)
    entries = []
    for kind in kinds:
        source = stand_in_source(kind, accepts_out)
        name = f"toy_{kind}" + ("_out" if accepts_out else "")
        (folder / "sm90" / f"{name}.py").write_text(source)
        spec = dict(
            name="toy",
            dtype="fp32",
            head_dim=16,
            head_dim_v=16,
            num_q_heads=4,
            num_kv_heads=2,
            mask="causal",
            causal_align="bottom_right",
            softcap=0.0,
            alibi=False,
        )
        if kind == "decode":
            spec.update(kv_layout="contiguous", page_size=None, max_query_tokens=4)
        entries.append(
            {
                "module": name,
                "path": f"sm90/{name}.py",
                "arch": "sm90",
                "kind": kind,
                "spec": spec,
                "sha256": hashlib.sha256(source.encode()).hexdigest(),
            }
        )
    (folder / "index.json").write_text(json.dumps({"schema": 1, "modules": entries}))
    return folder


def build_fake_decode(folder: Path) -> Path:
    """A folder holding one decode-kind module (contiguous cache, fp32, d16, causal)."""
    return build_stand_ins(folder, ("decode",))
