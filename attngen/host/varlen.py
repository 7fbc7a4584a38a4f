"""The varlen launcher's checks of its index tensors and lengths: _varlen_ok (comparisons
only), _check_varlen (names what fails) and the opt-in validation of their values.

Copied verbatim into varlen modules after checks.py (attngen/host/__init__.py).
"""

import torch


# -- host code: attngen/host/varlen.py, copied verbatim ----------------------------------------
def _varlen_ok(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k):
    """The success path of _check_varlen (q passed _tensors_ok), by comparisons only."""
    cuda, device = q.is_cuda, q.get_device()
    for t in (
        (cu_seqlens_q, cu_seqlens_k)
        if seqused_k is None
        else (cu_seqlens_q, cu_seqlens_k, seqused_k)
    ):
        if not (
            type(t) is torch.Tensor
            and t.dtype == torch.int32
            and t.dim() == 1
            and (t.is_cuda if cuda else t.is_cpu)
            and t.get_device() == device
            and t.is_contiguous()
        ):
            return False
    return (
        cu_seqlens_q.numel() >= 1
        and cu_seqlens_k.shape == cu_seqlens_q.shape
        and (seqused_k is None or seqused_k.numel() == cu_seqlens_q.numel() - 1)
        and type(max_seqlen_q) is int
        and max_seqlen_q >= 0
        and type(max_seqlen_k) is int
        and max_seqlen_k >= 0
    )


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k):
    """Shapes, dtypes and devices only: the lengths live on the device and are never read."""
    for name, t in (
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
        ("seqused_k", seqused_k),
    ):
        if t is None and name == "seqused_k":
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name}: expected a 1-D int32 tensor, got {got}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
        if not t.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous tensor (read with stride 1), got "
                f"strides {t.stride()}"
            )
    if cu_seqlens_q.numel() < 1 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            "cu_seqlens_q, cu_seqlens_k: expected the same shape [B + 1], got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    if seqused_k is not None and seqused_k.numel() != cu_seqlens_q.numel() - 1:
        raise ValueError(
            f"seqused_k: expected shape ({cu_seqlens_q.numel() - 1},) [B], "
            f"got {tuple(seqused_k.shape)}"
        )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name}: expected a Python int >= 0, got {n!r}")


def _validate_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k):
    """ATTNGEN_CHECKS=1: every sequence lies inside the packed tensors (a device sync). It
    raises exactly where the kernels would give a sequence NaN (they bound the same values on
    the device), and where a sequence is longer than max_seqlen_q."""
    bounds = {}
    for name, cu, rows, what in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q"),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k"),
    ):
        values = bounds[name] = cu.tolist()
        for i, value in enumerate(values if len(values) > 1 else []):
            if not 0 <= value <= rows:
                raise ValueError(f"{name}[{i}] = {value}: expected 0..{rows}, the rows of {what}")
            if i and value < values[i - 1]:
                raise ValueError(
                    f"{name}[{i}] = {value}: expected >= {name}[{i - 1}] = "
                    f"{values[i - 1]} (nondecreasing)"
                )
    cu_q, cu_k = bounds["cu_seqlens_q"], bounds["cu_seqlens_k"]
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] - cu_q[b] > max_seqlen_q:
            raise ValueError(
                f"cu_seqlens_q: sequence {b} has {cu_q[b + 1] - cu_q[b]} queries, "
                f"more than max_seqlen_q = {max_seqlen_q}"
            )
    for b, used in enumerate([] if seqused_k is None else seqused_k.tolist()):
        if not 0 <= used <= cu_k[b + 1] - cu_k[b]:
            raise ValueError(
                f"seqused_k[{b}] = {used}: expected 0..{cu_k[b + 1] - cu_k[b]}, "
                f"the keys cu_seqlens_k gives sequence {b}"
            )
