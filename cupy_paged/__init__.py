"""cupy_paged: paged attention for continuous-batching LLM inference.

Raw CUDA kernels compiled at run time through ``cupy.RawModule`` with
FlashAttention-2's API, a CPU reference backend (NumPy + numba) with the same API,
and a NumPy-style paged KV-cache manager and scheduler.

The layers, from the bottom: ``_core`` (the array boundary, the supported types, the
compiler), ``reference`` (the CPU backend) and ``kernels`` (the CUDA launch glue); ``api`` (the
public functions) beside ``serving`` (block pool, prefix cache, KV cache, scheduler: plain
data); ``runtime`` (the step plan that joins a scheduled step to the kernels); ``integrations``
(drop-ins for other frameworks, each imported only when asked for).
"""
__version__ = "0.1.0"

from ._core.errors import check_errors, set_debug  # noqa: E402
from .api.decode import flash_attn_with_kvcache  # noqa: E402
from .api.dense import flash_attn_func  # noqa: E402
from .api.indexing import block_table_from_lists, cu_seqlens_from_lengths, slot_mapping_from_positions  # noqa: E402
from .api.kv_write import write_kv_cache  # noqa: E402
from .api.merge import merge_attention_states  # noqa: E402
from .api.varlen import flash_attn_varlen_func  # noqa: E402
from .runtime.plan import PlanBuffers, StepPlan, build_plan  # noqa: E402
from .serving.block_pool import BlockPool, CacheFull  # noqa: E402
from .serving.kv_cache import PagedAttentionCache  # noqa: E402
from .runtime.scheduler import Scheduler  # noqa: E402
from .serving.scheduler import Request, RequestStatus, SamplingParams, SchedulerConfig  # noqa: E402

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
    "SamplingParams",
    "StepPlan",
    "PlanBuffers",
    "build_plan",
]
