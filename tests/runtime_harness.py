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
from attngen.runtime import registry as registry_module
from attngen.runtime.registry import load_kernels
from attngen.spec import specs_from_data

TOY_SPECS = [
    # causal bottom-right fp32, prefill and varlen (Llama-like, GQA 2:1)
    dict(name="toy", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2,
         mask="causal", causal_align="bottom_right", kernels=["prefill", "varlen"]),
    # SDPA's top-left causal, for Nq != Nk
    dict(name="toy_tl", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=2,
         mask="causal", causal_align="top_left", kernels=["prefill"]),
    # a window with softcap in fp16, head dim 32
    dict(name="toy_win", dtype="fp16", head_dim=32, num_q_heads=2, num_kv_heads=2,
         mask="sliding_window", causal_align="bottom_right", window_left=3, window_right=0,
         softcap=5.0, kernels=["prefill", "varlen"]),
    # no mask with ALiBi
    dict(name="toy_alibi", dtype="fp32", head_dim=16, num_q_heads=4, num_kv_heads=4,
         mask="none", alibi=True, kernels=["prefill"]),
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
    yield load_kernels(toy_folder)
    registry_module._current = saved


FAKE_DECODE = textwrap.dedent('''\
    """A stand-in decode module honouring the README's decode contract, in torch (test only)."""
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
    CALLS = []


    def decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None,
               v_new=None, sm_scale=None, alibi_slopes=None, return_lse=False):
        CALLS.append(q.shape)
        batch, heads, steps, dim = q.shape
        if k_new is not None:
            for b in range(batch):
                start = int(cache_seqlens[b])
                k_cache[b, :, start:start + k_new.shape[2]] = k_new[b]
                v_cache[b, :, start:start + v_new.shape[2]] = v_new[b]
        new = 0 if k_new is None else k_new.shape[2]
        out = torch.empty(batch, heads, steps, v_cache.shape[-1], dtype=q.dtype)
        lse = torch.empty(batch, heads, steps)
        group = heads // k_cache.shape[1]
        for b in range(batch):
            n = int(cache_seqlens[b]) + new
            k = k_cache[b, :, :n].repeat_interleave(group, 0).float()
            v = v_cache[b, :, :n].repeat_interleave(group, 0).float()
            s = q[b].float() @ k.transpose(-1, -2) * (sm_scale or 1 / math.sqrt(dim))
            i = torch.arange(steps)[:, None] + n - steps
            s = s.masked_fill(torch.arange(n)[None, :] > i, float("-inf"))
            lse[b] = torch.logsumexp(s, -1)
            out[b] = (torch.softmax(s, -1) @ v).to(q.dtype)
        return (out, lse) if return_lse else out
''')


def build_fake_decode(folder: Path) -> Path:
    """A folder holding one decode-kind module (contiguous cache, fp32, d16, causal)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sm90").mkdir(exist_ok=True)
    (folder / "sm90" / "toy_decode.py").write_text(FAKE_DECODE)
    spec = dict(name="toy", dtype="fp32", head_dim=16, head_dim_v=16, num_q_heads=4,
                num_kv_heads=2, mask="causal", causal_align="bottom_right", softcap=0.0,
                alibi=False, kv_layout="contiguous", page_size=None, max_query_tokens=4)
    entry = {"module": "toy_decode", "path": "sm90/toy_decode.py", "arch": "sm90",
             "kind": "decode", "spec": spec,
             "sha256": hashlib.sha256(FAKE_DECODE.encode()).hexdigest()}
    (folder / "index.json").write_text(json.dumps({"schema": 1, "modules": [entry]}))
    return folder
