"""CUDA glue: one module per kernel family, each registering its specializations.

``kv_write`` (write_kv_cache), ``decode`` (flash_attn_with_kvcache), ``varlen``
(flash_attn_varlen_func) and ``merge`` (merge_attention_states).  Each module's ``run`` takes a checked problem from
``cupy_paged._checks`` and launches on CuPy's current stream.
"""
from . import kv_write  # noqa: F401
from . import varlen  # noqa: F401
from . import decode  # noqa: F401
from . import merge  # noqa: F401
