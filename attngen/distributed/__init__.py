"""Context parallelism: attention over a sequence split across the ranks of a
torch.distributed group (docs/context_parallel.md).

    layout.py   which tokens each rank holds (contiguous, zigzag); shard, unshard, gather
    plan.py     which generated-kernel calls compute a rank's shard (pure Python)
    merge.py    the exact LSE merge of partial results (torch, and a Triton kernel for CUDA,
                merge_kernel.py, imported on first use)
    execute.py  the calls through the runtime, K/V around the ring or gathered
    backward.py the gradients: the same calls through the gradient kernels, dK/dV around the
                ring or reduce-scattered
    context.py  context_parallel_attention: checks, the strategy, autograd
"""

from attngen.distributed.context import (
    STRATEGIES,
    ContextParallelPlan,
    context_parallel_attention,
    last_plan,
)
from attngen.distributed.layout import (
    LAYOUTS,
    Chunk,
    gather_sequence,
    rank_chunks,
    shard_length,
    shard_sequence,
    unshard_sequence,
)
from attngen.distributed.plan import KernelCall, MaskRule, PlanError

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "Chunk",
    "ContextParallelPlan",
    "KernelCall",
    "MaskRule",
    "PlanError",
    "context_parallel_attention",
    "gather_sequence",
    "last_plan",
    "rank_chunks",
    "shard_length",
    "shard_sequence",
    "unshard_sequence",
]
