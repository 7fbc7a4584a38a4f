"""Tuning: measured tile configs that replace the heuristic's choice.

- database.py: the tuning files (tuning/<arch>.json), read by the build; imports neither
  torch nor triton.
- autotune.py: the loop that fills them on a GPU (`attngen autotune`; torch and triton);
  autotune_backward.py tunes the gradient kernels of specs with `backward: true`,
  autotune_gluon.py the sm90 Gluon forward's knobs, and
  measure.py holds what both loops share (buckets, the run's files and budget, the timer).
"""
