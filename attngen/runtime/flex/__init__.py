"""FlexAttention for attngen: torch's flex_attention and create_block_mask, whose Python
score_mod and mask_mod functions are traced (trace.py) into the spec's expression trees
(attngen.spec.expressions), block masks computed from them on the device (blocks.py), and calls
run by modules built on demand from them (attention.py)."""

from attngen.runtime.flex.attention import flex_attention
from attngen.runtime.flex.blocks import BlockMask, create_block_mask
from attngen.runtime.flex.trace import TraceError

__all__ = ["BlockMask", "TraceError", "create_block_mask", "flex_attention"]
