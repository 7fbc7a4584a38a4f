"""The host half the generated modules share, as ordinary Python (linted, typed, tested on
the CPU without a kernel: tests/test_host.py).

Each part is copied, from its `# -- host code:` line on, verbatim to the end of the modules
that use it (render.host_code), in the order of PARTS. The copied text uses only what every
module imports (the standard library, torch, triton); what an earlier part or the module
defines it imports or stands in above that line (not copied). What a spec decides (dtype,
head dims, configs, kernels) stays in the templates, as module constants and functions.
"""

# part -> (the kernel kinds whose modules hold it, the flag it needs), in the order copied.
PARTS = {
    "launch": (("prefill", "varlen", "decode"), None),
    "decode": (("decode",), None),  # the split rule, shared checks, the caches' size
    "checks": (("prefill", "varlen"), None),
    "varlen": (("varlen",), None),
    "tma": (("prefill", "varlen"), "tma"),  # Hopper's TMA K/V loads (render: code_paths' tma)
    "gluon": (("prefill", "varlen"), "gluon"),  # the warp-specialized forward (gluon_context)
    "gluon_varlen": (("varlen",), "gluon"),  # its packed-sequence layouts
    "plans": (("prefill", "varlen", "decode"), "call_plans"),  # call plans (render: call_plans)
    "prefill_plans": (("prefill",), "call_plans"),
    "varlen_plans": (("varlen",), "call_plans"),
    "decode_plans": (("decode",), "call_plans"),
    "expressions": (("prefill", "varlen", "decode"), "expressions"),  # score_mod / mask_mod
}
MARKER = "# -- host code:"
