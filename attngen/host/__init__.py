"""The host half the generated modules share, as ordinary Python (linted, typed, tested on
the CPU without a kernel: tests/test_host.py).

Each part is copied, from its `# -- host code:` line to its end, verbatim to the end of the
generated modules that use it (attngen/render.py, `host_code`), in the order of PARTS: its
kernel kinds, and the render context's flag that must be set for it (None: always). A module
stays standalone: the copied text uses only the standard library, torch and triton, which
every generated module imports above it; a part may name what an earlier part or the module
defines (it imports or stands it in above its `# -- host code:` line, which is not copied).
What a spec decides (the dtype, the head dims, the configs, the kernels) stays in the
templates, as the module's constants and functions, and reaches this code as arguments or by
those names.
"""

# part -> (the kernel kinds whose modules hold it, the flag it needs), in the order copied.
PARTS = {
    "launch": (("prefill", "varlen", "decode"), None),
    "checks": (("prefill", "varlen"), None),
    "varlen": (("varlen",), None),
    "tma": (("prefill",), "tma"),  # Hopper's TMA K/V loads (render: code_paths' tma)
    "gluon": (("prefill",), "gluon"),  # the warp-specialized forward (render: gluon_context)
    "plans": (("prefill", "varlen"), "call_plans"),  # call plans (render: call_plans)
    "prefill_plans": (("prefill",), "call_plans"),
    "varlen_plans": (("varlen",), "call_plans"),
    "expressions": (("prefill", "varlen", "decode"), "expressions"),  # score_mod / mask_mod
}
MARKER = "# -- host code:"
