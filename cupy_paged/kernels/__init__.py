"""The CUDA launch glue: one module per ``cuda_src/*.cu`` source, with the same stem.

Each module owns its source's specializations (``all_keys``), tile shapes and launch
(``*Launch`` classes resolve a checked call once; ``run`` launches it); ``registry`` lists
every family.  ``_launch`` holds what the launches share (the packed argument buffer, outputs),
``_workspace`` the device buffers they keep between calls.
"""
from . import decode, kv_write, merge, varlen, varlen_wgmma

__all__ = ["decode", "kv_write", "merge", "varlen", "varlen_wgmma"]
