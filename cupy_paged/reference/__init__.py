"""The CPU reference backend: NumPy + numba, the ground truth the kernels are tested against.

One module per public function of ``api/``, each with ``run``: it fills the outputs of a
checked call (``_core.problems``).  Arithmetic is float32 (like the kernels' accumulators)
for float16/bfloat16/float32 inputs and float64 for float64 inputs.
"""
from . import decode, kv_write, merge, varlen

__all__ = ["decode", "kv_write", "merge", "varlen"]
