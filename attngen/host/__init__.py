"""The host half the generated modules share, as ordinary Python (linted, typed, tested on
the CPU without a kernel: tests/test_host.py).

Each part is copied, from its `# -- host code:` line on, verbatim to the end of the modules
that use it (render.host_code), in the order of PARTS. The copied text uses only what every
module imports (the standard library, torch, triton); what an earlier part or the module
defines it imports or stands in above that line (not copied). What a spec decides (dtype,
head dims, configs, kernels) stays in the templates, as module constants and functions.
Here too: a module's header hash (template_hash), which the runtime checks without sympy.
"""

import hashlib
from functools import cache
from importlib import resources

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


@cache
def template_sources() -> dict[str, bytes]:
    """Every template (`*.py.jinja` of attngen/templates), by name, sorted: read once."""
    folder = resources.files("attngen").joinpath("templates")
    paths = sorted(
        (p for p in folder.iterdir() if p.name.endswith(".py.jinja")), key=lambda p: p.name
    )
    return {path.name: path.read_bytes() for path in paths}


@cache
def host_parts() -> dict[str, str]:
    """part -> attngen/host/<part>.py from its MARKER line on, verbatim (no final newline)."""
    folder = resources.files("attngen").joinpath("host")
    parts = {}
    for part in PARTS:
        text = folder.joinpath(f"{part}.py").read_text(encoding="utf-8")
        parts[part] = text[text.index("\n" + MARKER) + 1 :].rstrip("\n")
    return parts


@cache
def template_hash(template_name: str) -> str:
    """Hash of a template, every partial and the host code: a change to any shows in headers."""
    digest = hashlib.sha256()
    for name, data in template_sources().items():
        if name == template_name or name.startswith("_"):
            digest.update(name.encode() + b"\0" + data)
    for part, text in host_parts().items():
        digest.update(f"host/{part}.py".encode() + b"\0" + text.encode())
    return digest.hexdigest()[:16]
