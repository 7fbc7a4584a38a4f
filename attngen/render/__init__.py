"""Rendering: a validated spec plus a derived tile config -> the text of a standalone module.

Templates are package resources (`*.py.jinja`, partials prefixed `_`), loaded through
Jinja's bytecode cache (attngen/render/template_env.py), rendered with StrictUndefined from a
flat context of validated ints, bools and enum names. No user-provided text reaches a
template: the only strings in the context are enum values, the validated identifier `name`
(for the module name and docstring) and lines attngen writes itself. Every rendered module is
parsed with `ast` and its imports and top-level names checked before it is
returned (`check_module_source`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from attngen.host import PARTS as HOST_PARTS
from attngen.host import host_parts, template_hash
from attngen.render.template_env import environment
from attngen.spec import AttnSpec, KernelKind, module_name
from attngen.spec.expression_grad import gradients
from attngen.spec.expressions import (
    GLUON_NAMES,
    KERNEL_NAMES,
    Expr,
    Tensor,
    declared,
    parsed,
    render,
    render_mod,
    validity,
)
from attngen.spec.names import __version__
from attngen.tiling import decode as decode_tiling
from attngen.tiling.backward import BackwardDerivation, atomic_dkdv_config, derive_backward_tiles
from attngen.tiling.code_paths import POINTER_LOADS_UP_TO, code_paths
from attngen.tiling.decode_latent import derive_latent_tiles
from attngen.tiling.gluon import GluonDerivation, derive_gluon_tiles, gluon_gap
from attngen.tiling.gluon_backward import HEAVY_FIRST, SHORT_CAUSAL_KEYS, derive_gluon_backward
from attngen.tiling.gluon_backward import LONG_CAUSAL_KEYS as LONG_KEYS
from attngen.tiling.prefill import Derivation, TileConfig, padded_head_dim

# A generated module may import these and nothing else.
ALLOWED_IMPORTS = frozenset(
    {"contextlib", "math", "os", "threading", "torch", "triton", "triton.language"}
)
_GLUON_HOPPER = "triton.experimental.gluon.language.nvidia.hopper"
ALLOWED_FROM_IMPORTS = frozenset(
    {
        ("triton.tools.tensor_descriptor", "TensorDescriptor"),
        # The warp-specialized forward of sm90 prefill modules (_gluon_kernel.py.jinja).
        ("triton.experimental", "gluon"),
        ("triton.experimental.gluon", "language"),
        ("triton.experimental.gluon.nvidia.hopper", "TensorDescriptor"),
        *((_GLUON_HOPPER, name) for name in ("fence_async_shared", "mbarrier", "tma",
                                             "warpgroup_mma", "warpgroup_mma_wait")),
        # an arrive on an mbarrier from every thread (no warpgroup sync before one thread's)
        ("triton.experimental.gluon.language.nvidia.ampere", "async_copy"),
    }
)  # fmt: skip
# varlen is the prefill template with its `varlen` flag set: one kernel, two ways to find a
# sequence. Each kind's public entry point is what the runtime calls and the ast gate requires.
TEMPLATE_FOR_KIND = {
    KernelKind.prefill: "prefill.py.jinja",
    KernelKind.varlen: "prefill.py.jinja",
    KernelKind.decode: "decode.py.jinja",
}
ENTRY_POINTS = {
    KernelKind.prefill: "attention",
    KernelKind.varlen: "attention_varlen",
    KernelKind.decode: "decode",
}


class RenderError(RuntimeError):
    """A rendered module failed its safety gate: a bug in attngen, never a user mistake."""


def host_code(kind: KernelKind, **flags: bool) -> str:
    """The host code at the end of a module of this kind: its parts, in order, those that need
    a flag only where `flags` sets it (attngen/host/__init__.py, PARTS)."""
    texts = [
        text
        for part, text in host_parts().items()
        if kind.value in HOST_PARTS[part][0] and flags.get(HOST_PARTS[part][1] or "", True)
    ]
    return "\n\n\n".join(texts)


# decode's names (decode.py.jinja): its packed query tile's rows are (query head, token) pairs,
# so h and q_idx are per row: offs_h, and q_pos, the token's position in its sequence.
DECODE_NAMES = KERNEL_NAMES | {"h": "offs_h[:, None]", "q_idx": "q_pos[:, None]"}


def expression_context(spec: AttnSpec, kind: KernelKind | None = None) -> dict[str, Any]:
    """score_mod and mask_mod as kernel text rendered from their checked trees ("" where
    unset; in `kind`'s names: DECODE_NAMES for decode), and the declared tensors' kernel
    arguments: a pointer each (expr_pointers), then as ints each one's strides and each named
    dim's size (expr_ints), in the order the host's _expression_tensors gives them;
    expr_declared is the declarations as a Python literal."""
    tensors = declared(spec)
    names = DECODE_NAMES if kind is KernelKind.decode else KERNEL_NAMES
    texts = {field: _mod_text(spec, field, names) for field in ("score_mod", "mask_mod")}
    gluon = {f"gluon_{f}": _mod_text(spec, f, GLUON_NAMES) for f in ("score_mod", "mask_mod")}
    dims = list(dict.fromkeys(d for t in tensors for d in t.shape if isinstance(d, str)))
    strides = [f"{t.name}_stride{axis}" for t in tensors for axis in range(len(t.shape))]
    return {
        **texts,
        **gluon,  # the warp-specialized forward's (_gluon_kernel.py.jinja)
        "expr_pointers": [f"{t.name}_ptr" for t in tensors],
        "expr_ints": strides + [f"dim_{d}" for d in dims],
        "expr_strides": strides,
        "expr_declared": repr(tuple((t.name, t.dtype, t.shape) for t in tensors)),
        "expr_tanh": any("_tanh(" in text for text in texts.values()),  # the module's _tanh
    }


def _mod_text(spec: AttnSpec, field: str, names: dict[str, str]) -> str:
    """The field's kernel text under `names` ("" where unset); a score_mod that does not
    read the score is still a tile (of the score's shape)."""
    tree = parsed(spec, field)
    if tree is None:
        return ""
    text = render_mod(field, tree, declared(spec), names)
    if field == "score_mod" and not any(n.op == "var" and n.value == "score" for n in tree.nodes()):
        text = f"{names['tl']}.zeros_like({names['score']}) + {text}"
    return text


# The gradient kernels' names for the expressions' variables (_backward_dq.py.jinja,
# _backward_dkdv.py.jinja): the dQ kernel's tile is [BLOCK_M, BLOCK_N] as the forward's, the
# dK/dV kernel's transposed, [BLOCK_N, BLOCK_M], its query head first_head + group_head; the
# score is the pre-mod scaled score, as the forward's score_mod reads it.
BACKWARD_NAMES = {
    "dq": KERNEL_NAMES | {"q_idx": "q_rows32[:, None]"},
    "dkdv": KERNEL_NAMES
    | {"score": "qkT", "h": "(first_head + group_head)"}
    | {"q_idx": "rows[None, :]", "kv_idx": "key_pos[:, None]"},
    # the Gluon dK/dV kernel's [ROWS, BLOCK_M] tile (keys by row): _gluon_bwd_scores's names
    "gluon": GLUON_NAMES
    | {"score": "sc", "h": "q_head", "q_idx": "qpos[None, :]", "kv_idx": "kpos[:, None]"},
}


def backward_expression_context(spec: AttnSpec) -> dict[str, Any]:
    """score_mod and mask_mod in each gradient kernel's names (bwd_dq, bwd_dkdv, bwd_gluon),
    score_mod's derivative by the score there (`dscore`, attngen.spec.expression_grad), and in
    the dK/dV kernel each trainable read's (tensor, derivative, offset into its fp32 gradient,
    bounds): `tensor_grads`; the trainable tensors' gradient pointers and strides (kernel
    arguments)."""
    tensors = declared(spec)
    tree = parsed(spec, "score_mod")
    derived = gradients(tree, tensors) if tree is not None else {}
    reads = {str(n): n for n in tree.nodes() if n.op == "load"} if tree is not None else {}
    context: dict[str, Any] = {}
    for kernel, names in BACKWARD_NAMES.items():
        context[f"bwd_{kernel}"] = {
            "score_mod": _mod_text(spec, "score_mod", names),
            "mask_mod": _mod_text(spec, "mask_mod", names),
            "dscore": render(derived["score"], tensors, True, names) if derived else "",
        }
    context["bwd_dkdv"]["tensor_grads"] = [  # the dK/dV kernel adds them
        (str(reads[key].value), render(grad, tensors, True, BACKWARD_NAMES["dkdv"]))
        + _gradient_target(reads[key], tensors, BACKWARD_NAMES["dkdv"])
        for key, grad in derived.items()
        if key != "score"
    ]
    trainable = [t for t in tensors if t.trainable]
    texts = [v for kernel in BACKWARD_NAMES for v in context[f"bwd_{kernel}"].values()]
    return context | {
        "expr_trainable": [t.name for t in trainable],
        "expr_trained": repr(tuple(t.name for t in trainable)),  # a Python literal
        "expr_grad_pointers": [f"{t.name}_grad_ptr" for t in trainable],
        "expr_grad_strides": [
            f"{t.name}_grad_stride{a}" for t in trainable for a in range(len(t.shape))
        ],
        "expr_tanh": "_tanh(" in repr(texts),
    }


def _gradient_target(
    read: Expr, tensors: tuple[Tensor, ...], names: dict[str, str]
) -> tuple[str, str]:
    """(offset, bounds) of a trainable read in its fp32 gradient buffer: the read's index at
    the buffer's strides, and where the index is inside the tensor ("True": always)."""
    index = [render(i, tensors, names=names) for i in read.args]
    offset = " + ".join(f"({i}) * {read.value}_grad_stride{a}" for a, i in enumerate(index))
    bounds = validity(read, {t.name: t for t in tensors})
    return offset, "True" if bounds is None else render(bounds, tensors, names=names)


def build_context(
    spec: AttnSpec,
    kind: KernelKind,
    derivation: Derivation,
    backward: BackwardDerivation | None = None,
    gluon: GluonDerivation | None = None,
) -> dict[str, Any]:
    """The flat context of one render; `backward`: the gradient kernels' (else heuristic);
    `gluon`: the Gluon forward's of a prefill module (tuned_gluon; else derived)."""
    config = derivation.chosen
    if config is None:
        raise RenderError(f"{spec.name} on {derivation.arch}: no feasible tile config to render")
    window = spec.window or (0, 0)
    context = {
        **_provenance_context(spec, kind, derivation.arch),
        "block_m": config.block_m,
        "block_n": config.block_n,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "config_source": derivation.source,
        # Python literals of (longest sequence, config) pairs, built here from ints only.
        "shorter_configs": [f"({up_to}, {_config_literal(c)})" for up_to, c in derivation.shorter],
        "derivation_lines": list(derivation.summary_lines()),
        "dtype": spec.dtype.value,
        "dtype_name": spec.dtype.torch_name,
        "head_dim": spec.head_dim,
        "head_dim_v": spec.value_head_dim,
        "block_d": padded_head_dim(spec.head_dim),
        "block_dv": padded_head_dim(spec.value_head_dim),
        "mask": spec.mask.value,
        "causal_align": spec.causal_align.value if spec.causal_align else "none",
        "bottom_right": spec.causal_align is not None and spec.causal_align.value == "bottom_right",
        "window_left": window[0],
        "window_right": window[1],
        "softcap": float(spec.softcap),
        "alibi": spec.alibi,
        # Newer models' fields: 0 / False when absent (templates emit code only when set).
        "sinks": spec.sinks,
        "chunk_size": spec.chunk_size or 0,
        "sink_tokens": spec.sink_tokens or 0,
        "varlen": kind is KernelKind.varlen,
    }
    context.update(_host_paths_context(spec, kind, derivation.arch))
    context.update(expression_context(spec, kind))
    context.update(_training_context(spec, kind, derivation, backward))
    _add_gluon(context, spec, kind, derivation.arch, gluon)
    # attngen/host's parts for this kind and these paths, verbatim: the module's last lines
    flags = {flag: bool(context[flag]) for flag in ("tma", "gluon", "call_plans")}
    if kind is KernelKind.varlen:  # TMA's host part only for the Gluon forward's layout checks
        flags["tma"] = flags["gluon"]
    flags["expressions"] = spec.score_mod is not None or spec.mask_mod is not None
    context["host_code"] = host_code(kind, **flags)
    if kind is KernelKind.decode:
        context.update(_decode_context(spec, derivation.arch))
    return context


def _decode_context(spec: AttnSpec, arch: str) -> dict[str, Any]:
    """A decode module's own names: its cache, query tokens and split rule."""
    # (latent, rope) dims of an absorbed MLA decode, else 0: q.k in two dots
    rope_dim = (decode_tiling.latent_rope_split(spec) or (0, 0))[1]
    return {
        "kv_layout": spec.cache_layout.value,
        "page_size": spec.page_size or 0,
        "max_query_tokens": spec.query_tokens,
        "max_query_tokens_pow2": 1 << (spec.query_tokens - 1).bit_length(),  # tl.arange's
        "kv_fp8": spec.kv_dtype is not None,  # fp8 e4m3 caches with descales
        "split_waves": decode_tiling.SPLIT_WAVES,
        "min_blocks_per_split": decode_tiling.MIN_BLOCKS_PER_SPLIT,
        "max_splits": decode_tiling.MAX_SPLITS,
        "interpreter_sm_count": decode_tiling.INTERPRETER_SM_COUNT,
        "rope_dim": rope_dim,
        **({"separate_v_config": _separate_v_config(spec, arch)} if rope_dim else {}),
    }


def _separate_v_config(spec: AttnSpec, arch: str) -> str:
    """The absorbed MLA decode's tile for a v_cache of its own (not k_cache's latent view)."""
    separate = derive_latent_tiles(spec, arch, v_from_k=False).chosen
    if separate is None:
        raise RenderError(f"{spec.name} on {arch}: no tile fits a separate v_cache")
    return _config_literal(separate)


def _provenance_context(spec: AttnSpec, kind: KernelKind, arch: str) -> dict[str, Any]:
    """What the generated header records about where the module came from: attngen's
    version, the template and its hash, the module name, the spec, its hash and the arch."""
    return {
        "attngen_version": __version__,
        "template_name": TEMPLATE_FOR_KIND[kind],
        "template_hash": template_hash(TEMPLATE_FOR_KIND[kind]),
        "module_name": module_name(spec, kind),
        "spec_hash": spec.spec_hash(),
        "spec_lines": [f"{key}: {_yaml_value(value)}" for key, value in spec.canonical().items()],
        "arch": arch,
    }


def _host_paths_context(spec: AttnSpec, kind: KernelKind, arch: str) -> dict[str, Any]:
    """Hopper's tensor-memory accelerator for K/V blocks and the causal schedule (the choices
    and their measurements are in code_paths.py), and whether attention() keeps call plans
    (attngen/host/prefill_plans.py: prefill launchers whose calls bring no tensors beyond q,
    k, v and out; sinks, dropout and expression tensors do), as attention_varlen()
    (host/varlen_plans.py) and decode() (host/decode_plans.py) do without them."""
    paths = code_paths(spec, arch, kind)
    dense = kind in (KernelKind.prefill, KernelKind.varlen) and not (spec.backward and spec.dropout)
    return {
        "tma": paths.tma,
        "tma_masked_blocks": paths.tma_masked_blocks,
        "lpt_group_heads": paths.lpt_group_heads,
        "pointer_loads_up_to": POINTER_LOADS_UP_TO,
        "call_plans": not spec.sinks and not spec.tensors and (kind is KernelKind.decode or dense),
    }


_GLUON_INTS = ("gluon_consumers", "gluon_block_m", "gluon_block_n", "gluon_stages",
               "gluon_consumer_regs", "gluon_producer_regs", "gluon_maxnreg")  # fmt: skip


def gluon_context(
    spec: AttnSpec, kind: KernelKind, arch: str, gluon: GluonDerivation | None = None
) -> dict[str, Any]:
    """The warp-specialized forward's flag and config (`gluon`, else attngen/tiling/gluon.py's
    derivation), or, for a module without it, why not (`gluon_gap`: a line attngen writes, for
    forward_path())."""
    gap = gluon_gap(spec, arch, kind) if kind is not KernelKind.decode else "decode"
    gluon = (gluon or derive_gluon_tiles(spec, arch, kind)) if not gap else None
    if gluon is None or gluon.chosen is None:
        off = dict.fromkeys(_GLUON_INTS, 0)
        return {"gluon": False, "gluon_gap": gap or "no Gluon config fits", **off}
    config = gluon.chosen.config
    return {
        "gluon": True,
        "gluon_gap": "",
        "gluon_consumers": config.consumers,
        "gluon_block_m": config.block_m,
        "gluon_block_n": config.block_n,
        "gluon_stages": config.stages,
        "gluon_consumer_regs": config.consumer_regs,
        "gluon_producer_regs": config.producer_regs,
        "gluon_maxnreg": config.maxnreg,
    }


def _add_gluon(context: dict[str, Any], spec: AttnSpec, kind: KernelKind, arch: str,
               gluon: GluonDerivation | None) -> None:  # fmt: skip
    """gluon_context into `context`, and the Gluon backward's (gluon_bwd: its flag); the
    header's derivation ends with the Gluon forward's and backward's."""
    context.update(gluon_context(spec, kind, arch, gluon))
    gluon = (gluon or derive_gluon_tiles(spec, arch, kind)) if context["gluon"] else None
    if gluon is not None:
        context["derivation_lines"] = [*context["derivation_lines"], *gluon.summary_lines()]
    prefill = context["gluon"] and kind is KernelKind.prefill  # no Gluon varlen backward
    backward = derive_gluon_backward(spec, arch) if prefill else None
    chosen = backward.chosen if backward is not None else None
    context["gluon_bwd"] = chosen is not None
    if backward is not None and chosen is not None:
        context["derivation_lines"] = [*context["derivation_lines"], *backward.summary_lines()]
        config, wide = chosen.config, backward.long_causal and backward.long_causal.config
        long = wide and (LONG_KEYS, wide.block_m, wide.stages, wide.dq_split)
        context.update(gluon_bwd_block_m=config.block_m, gluon_bwd_block_n=config.block_n,
                       gluon_bwd_stages=config.stages, gluon_bwd_dq_split=config.dq_split,
                       gluon_bwd_dq_late=config.dq_late,
                       gluon_bwd_regs=(config.consumer_regs, config.producer_regs, config.maxnreg),
                       gluon_bwd_describe=config.describe(),
                       gluon_bwd_long=long,
                       gluon_bwd_short_causal=SHORT_CAUSAL_KEYS,
                       gluon_bwd_heavy_first=HEAVY_FIRST)  # fmt: skip


def _training_context(
    spec: AttnSpec, kind: KernelKind, derivation: Derivation, backward: BackwardDerivation | None
) -> dict[str, Any]:
    """The backward's context (spec `backward: true`, prefill and varlen): its flags, the
    gradient kernels' configs, and their derivations appended to the header's."""
    training = kind is not KernelKind.decode and spec.backward
    context: dict[str, Any] = {"backward": training, "dropout": training and spec.dropout}
    if not training:
        return context
    if backward is None:
        backward = derive_backward_tiles(spec, derivation.arch)
    for label, kernel in (("dq", backward.dq), ("dkdv", backward.dkdv)):
        if kernel.chosen is None:
            raise RenderError(
                f"{spec.name} on {derivation.arch}: no feasible {label} backward tile config"
            )
        context[f"bwd_{label}_config"] = _config_literal(kernel.chosen)
    context["bwd_dkdv_split"] = (
        f"({_config_literal(backward.dv.chosen)}, {_config_literal(backward.dk.chosen)})"  # type: ignore[arg-type]
        if backward.split
        else "None"
    )
    atomic = atomic_dkdv_config(spec, derivation.arch, backward)
    context["bwd_dkdv_atomic_config"] = "None" if atomic is None else _config_literal(atomic)
    context["derivation_lines"] = [*derivation.summary_lines(), *backward.summary_lines()]
    context.update(backward_expression_context(spec))
    return context


def _config_literal(config: TileConfig) -> str:
    return (f'{{"BLOCK_M": {config.block_m}, "BLOCK_N": {config.block_n}, '
            f'"num_warps": {config.num_warps}, "num_stages": {config.num_stages}}}')  # fmt: skip


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def render_module(spec: AttnSpec, kind: KernelKind, derivation: Derivation,
                  backward: BackwardDerivation | None = None,
                  gluon: GluonDerivation | None = None) -> str:  # fmt: skip
    context = build_context(spec, kind, derivation, backward, gluon)
    source = render_template(TEMPLATE_FOR_KIND[kind], context)
    check_module_source(source, context["module_name"], ENTRY_POINTS[kind])
    return source


def kernels_text(source: str) -> str:
    """The JIT functions of a rendered prefill module (from the first @triton.jit to the
    launcher's helpers): the part a template change alters, without the header and CONFIG."""
    return source[source.index("@triton.jit") : source.index("\ndef _check_alibi")]


def render_template(template_name: str, context: dict[str, Any]) -> str:
    """Render any template from an explicit context (used by golden-file tests)."""
    return environment().get_template(template_name).render(**context)


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """Every statement of tree, nested ones too, without the expressions (an import is a
    statement, and no expression holds one; ast.walk's every node cost 15 ms a module)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            pending.extend(getattr(node, field, ()))


def check_module_source(source: str, name: str, entry: str = "attention") -> None:
    """The ast gate: the module parses, imports only what ALLOWED_IMPORTS and
    ALLOWED_FROM_IMPORTS name, and defines its entry point (`attention` for prefill)."""
    try:
        tree = ast.parse(source, filename=f"{name}.py")
    except SyntaxError as exc:
        raise RenderError(f"{name}: rendered module does not parse: {exc}") from None
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in ALLOWED_IMPORTS:
                    raise RenderError(f"{name}: rendered module imports {alias.name!r}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.level or (node.module, alias.name) not in ALLOWED_FROM_IMPORTS:
                    module = node.module or ""
                    raise RenderError(
                        f"{name}: rendered module imports {module!r} (name {alias.name!r})"
                    )
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    if entry not in defined:
        raise RenderError(f"{name}: rendered module defines no {entry}()")
