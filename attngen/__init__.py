"""attngen: specialized FlashAttention-style Triton kernels generated from a YAML spec."""

__version__ = "0.1.0"
