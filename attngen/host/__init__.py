"""The host half the generated modules share, as ordinary Python (linted, typed, tested on
the CPU without a kernel: tests/test_host.py).

Each part is copied, from its `# -- host code:` line to its end, verbatim to the end of the
generated modules that use it (attngen/render.py, `host_code`), in the order of PARTS:
launch (every module), checks (prefill and varlen), varlen (varlen), expressions (the
modules whose spec has score_mod or mask_mod: OPTIONAL_PARTS). A module stays
standalone: the copied text uses only the standard library, torch and triton, which every
generated module imports above it; a part may name what an earlier part defines (it imports
it from there above its `# -- host code:` line, which is not copied). What a spec decides
(the dtype, the head dims, the configs) stays in the templates, as the module's constants,
and reaches this code as arguments.
"""

# The parts in the order they are copied, and the kernel kinds whose modules hold each.
PARTS = {
    "launch": ("prefill", "varlen", "decode"),
    "checks": ("prefill", "varlen"),
    "varlen": ("varlen",),
    "expressions": ("prefill", "varlen", "decode"),
}
OPTIONAL_PARTS = ("expressions",)  # only in modules whose spec needs them (render.host_code)
MARKER = "# -- host code:"
