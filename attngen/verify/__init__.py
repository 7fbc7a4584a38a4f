"""The compiler check: the tiling model against what Triton's compiler really allocates.

- compiler.py: cross-compiles a generated kernel (prefill or decode) for any target without a
  GPU and measures it (shared memory, registers, spills, the matrix instructions). The only
  module here that imports triton, and only when it compiles; check.py loads it only for
  live compiles, so reading the measurements (verify-tiling, capabilities) needs no triton.
- measurements.py: the committed compiler measurements (data/, one file per Triton version
  and kernel), read without torch or triton.
- check.py: `attngen verify-tiling`, the model against the measurements.
- policy.py: what each compiled row is held to (spill and shared-memory bounds).
- backward.py: the same for the backward kernels (`verify-tiling --backward`): their plan
  and which measurements a run reads.
- report.py: that comparison in tables and JSON.

"Compiler check" and "measurements" name this side; the float64 ground truth the kernels are
tested against is the "reference" (attngen/reference/__init__.py).
"""
