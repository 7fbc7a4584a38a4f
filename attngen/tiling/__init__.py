"""Tiling: from a validated spec and a GPU target to a launch config, with the derivation.

- prefill_model.py: the sympy model of what a prefill config costs (shared memory,
  registers, a score, waves); backward_model.py and gluon_model.py those of the gradient and
  the Gluon kernels.
- evaluate.py: the models compiled ahead (model_store.json, written by tools/model_store.py),
  so that a derivation neither builds an expression nor imports sympy; symbolic.py: sympy's
  side of it (the store's entries, and any model the store lacks).
- prefill.py: every candidate of the grid with its verdict under that model, and the
  choice. Its TileConfig, Candidate and
  Derivation are the stage's vocabulary: decode reuses them, because the decode kernel runs
  the prefill kernel's key loop.
- decode.py: the decode tile (the same model with a bandwidth score) and the split rule.
- code_paths.py: the paths a prefill module takes besides its config (TMA loads, the causal
  schedule), chosen per arch from measurements.
- alternatives.py: when nothing fits, the nearest change to the spec that does.

Pure Python and sympy (the *_model.py and symbolic.py only): nothing here imports torch or
triton.
"""
