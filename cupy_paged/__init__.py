"""cupy_paged: paged attention for continuous-batching LLM inference.

Raw CUDA kernels compiled at run time through ``cupy.RawModule`` with
FlashAttention-2's API, a CPU reference backend (NumPy + numba) with the same API,
and a NumPy-style paged KV-cache manager and scheduler.
"""
__version__ = "0.1.0"

from ._errors import check_errors, set_debug  # noqa: E402
from .attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_cache  # noqa: E402
from .block_pool import BlockPool, CacheFull  # noqa: E402
from .cache import PagedAttentionCache  # noqa: E402
from .layout import block_table_from_lists, cu_seqlens_from_lengths, slot_mapping_from_positions  # noqa: E402
from .merge import merge_attention_states  # noqa: E402
from .plan import PlanBuffers, StepPlan, build_plan  # noqa: E402
from .scheduler import Request, RequestStatus, Scheduler, SchedulerConfig  # noqa: E402

__all__ = [
    "flash_attn_varlen_func",
    "flash_attn_func",
    "check_errors",
    "set_debug",
    "flash_attn_with_kvcache",
    "write_kv_cache",
    "merge_attention_states",
    "cu_seqlens_from_lengths",
    "block_table_from_lists",
    "slot_mapping_from_positions",
    "PagedAttentionCache",
    "BlockPool",
    "CacheFull",
    "Scheduler",
    "SchedulerConfig",
    "Request",
    "RequestStatus",
    "StepPlan",
    "PlanBuffers",
    "build_plan",
]
