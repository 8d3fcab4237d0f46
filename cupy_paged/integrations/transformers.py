"""Hugging Face transformers on cupy_paged: ``install()`` makes ``attn_implementation="flash_attention_2"``
(``model.generate``, any forward) and continuous batching's ``paged|flash_attention_2``
(``model.generate_batch``) run on cupy_paged's ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``, with no flash-attn package installed.

>>> import transformers, cupy_paged.integrations.transformers as cp_hf   # doctest: +SKIP
>>> cp_hf.install()                                                       # doctest: +SKIP
>>> model = transformers.AutoModelForCausalLM.from_pretrained(
...     path, dtype=torch.bfloat16, attn_implementation="flash_attention_2").cuda()     # doctest: +SKIP
>>> out = model.generate_batch(prompts, generation_config)               # doctest: +SKIP
>>> cp_hf.uninstall()                                                     # doctest: +SKIP

On CUDA tensors the CUDA kernels run (float16 / bfloat16) on torch's current stream; on CPU tensors
the CPU reference backend runs (float32 too), which is what the CPU tests use.  Head dims 32, 64,
96, 128 and 256.  Attention sinks (``s_aux``, e.g. gpt-oss) are refused with ``NotImplementedError`` rather than
dropped.  Inference only: the functions compute no gradient (torch inputs that require one draw a
warning).  On the CPU, transformers 5.17's ``generate_batch`` sizes its cache from ``psutil`` and
raises ``MemoryError`` without it: ``pip install psutil`` there.

Tested with transformers **5.17.0** and **5.24.0** (:data:`TESTED_VERSIONS`); ``install()`` raises
``RuntimeError`` naming the installed version on any other (``allow_untested=True`` skips the check).
torch and transformers are imported only here, and only when ``install()`` runs.

How it plugs in
---------------
transformers' public extension points are ``AttentionInterface.register`` (the attention *wrapper*
a model calls, by name), ``ALL_MASK_ATTENTION_FUNCTIONS`` (the mask built for that name) and the
kernels-hub fallback (``integrations.hub_kernels.load_and_register_attn_kernel``).  The first two
already hold transformers' own FlashAttention-2 wrappers and masks under ``flash_attention_2`` and
``paged|flash_attention_2`` (``integrations.flash_attention.flash_attention_forward``, 5.17's
``integrations.flash_paged.paged_attention_forward``), and those are kept unchanged, so padding,
packed sequences, sliding windows, softcap and the paged cache are handled exactly as on
FlashAttention-2.  What those wrappers call -- the three kernel functions -- is resolved by
``modeling_flash_attention_utils.lazy_import_flash_attention`` in ``_lazy_imports``, whose only
hook is the kernels hub: it needs the ``kernels`` package and a Hub download, and is skipped
altogether when a real flash-attn is installed.  So three internals are patched, each restored by
:func:`uninstall`:

1. ``modeling_flash_attention_utils._lazy_imports`` -- wrapped: for ``flash_attention_2`` (with or
   without ``paged|``) it returns cupy_paged's functions and transformers' own pad / unpad helpers;
   any other name goes to the original.  The module's one-entry cache (``_loaded_implementation``)
   is cleared when it holds one of these names, so the next call resolves anew.
2. ``FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]`` -- replaced by a copy whose
   ``general_availability_check`` says yes, so ``PreTrainedModel._check_and_adjust_attn_implementation``
   does not reroute ``flash_attention_2`` to the Hub kernel ``kernels-community/flash-attn2`` where
   the ``kernels`` package is installed.
3. ``PreTrainedModel._flash_attn_can_dispatch`` -- wrapped: for version 2 on a model that supports
   flash attention it passes (the original asks for the flash-attn package and rejects a model on
   the CPU); the rest goes to the original, which still rejects models without flash support.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref

TESTED_VERSIONS = ("5.17.0", "5.24.0")
IMPLEMENTATIONS = ("flash_attention_2", "paged|flash_attention_2")

_lock = threading.Lock()
_saved: dict | None = None  # the originals while installed


def check_version(version: str | None = None) -> str:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed transformers') is one of
    :data:`TESTED_VERSIONS`; return it."""
    if version is None:
        import transformers

        version = transformers.__version__
    if version not in TESTED_VERSIONS:
        raise RuntimeError(
            f"cupy_paged.integrations.transformers is tested with transformers {' and '.join(TESTED_VERSIONS)}; "
            f"the installed transformers is {version}. Install one of those, or call "
            f"install(allow_untested=True) to try this one anyway.")
    return version


def is_installed() -> bool:
    """Whether :func:`install` is in force."""
    return _saved is not None


def install(*, allow_untested: bool = False) -> None:
    """Make transformers' ``flash_attention_2`` and ``paged|flash_attention_2`` run on cupy_paged.

    Idempotent; undone by :func:`uninstall`.  Load or switch the model after this call
    (``from_pretrained(..., attn_implementation="flash_attention_2")`` or
    ``model.set_attn_implementation("flash_attention_2")``), then call ``model.generate(...)`` or
    ``model.generate_batch(...)`` as usual.

    Raises
    ------
    RuntimeError
        transformers is not one of :data:`TESTED_VERSIONS` (unless ``allow_untested``).
    ImportError
        torch or transformers is not installed.
    """
    global _saved
    with _lock:
        if _saved is not None:
            return
        import transformers  # noqa: F401  (lazily: only here)

        if not allow_untested:
            check_version()
        from transformers import modeling_flash_attention_utils as mfau
        from transformers import modeling_utils

        matrix = mfau.FLASH_ATTENTION_COMPATIBILITY_MATRIX
        saved = {"lazy_imports": mfau._lazy_imports, "matrix_entry": matrix[2],
                 "can_dispatch": modeling_utils.PreTrainedModel.__dict__["_flash_attn_can_dispatch"]}
        functions = _functions(mfau)
        original_lazy, original_dispatch = saved["lazy_imports"], saved["can_dispatch"]

        @functools.wraps(original_lazy)
        def _lazy_imports(implementation, *args, **kwargs):
            if implementation in IMPLEMENTATIONS:
                return functions
            return original_lazy(implementation, *args, **kwargs)

        @functools.wraps(original_dispatch)
        def _flash_attn_can_dispatch(self, flash_attn_version, is_init_check=False):
            if flash_attn_version == 2 and self._supports_flash_attn:
                return True
            return original_dispatch(self, flash_attn_version, is_init_check=is_init_check)

        mfau._lazy_imports = _lazy_imports
        matrix[2] = {**saved["matrix_entry"], "general_availability_check": _available}
        modeling_utils.PreTrainedModel._flash_attn_can_dispatch = _flash_attn_can_dispatch
        _forget_loaded(mfau)
        _saved = saved


def uninstall() -> None:
    """Undo :func:`install`: transformers resolves ``flash_attention_2`` as it did before (a model
    already switched to it then needs the flash-attn package again).  A no-op when not installed."""
    global _saved
    with _lock:
        if _saved is None:
            return
        from transformers import modeling_flash_attention_utils as mfau
        from transformers import modeling_utils

        mfau._lazy_imports = _saved["lazy_imports"]
        mfau.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2] = _saved["matrix_entry"]
        modeling_utils.PreTrainedModel._flash_attn_can_dispatch = _saved["can_dispatch"]
        _forget_loaded(mfau)
        _saved = None


def _available(*args, **kwargs) -> bool:
    return True


# transformers' module-level cache of the resolved flash functions (modeling_flash_attention_utils).
_CACHED_FUNCTIONS = ("_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn",
                     "_process_flash_kwargs_fn")


def _forget_loaded(mfau) -> None:
    """Clear transformers' one-entry cache of resolved flash functions if it holds one of ours: the
    name and the functions (a resolution that fails after uninstall() leaves the name set, and the
    next call would run the functions still cached)."""
    if getattr(mfau, "_loaded_implementation", None) in IMPLEMENTATIONS:
        mfau._loaded_implementation = None
        for name in _CACHED_FUNCTIONS:
            if hasattr(mfau, name):
                setattr(mfau, name, None)


def _functions(mfau) -> tuple:
    """What ``_lazy_imports`` returns, in its order: the dense, varlen and paged-decode functions
    (cupy_paged's, through :func:`_adapted`) and transformers' own ``pad_input`` / ``unpad_input``."""
    import torch

    import cupy_paged

    return (_adapted(cupy_paged.flash_attn_func, torch), _adapted(cupy_paged.flash_attn_varlen_func, torch),
            _adapted(cupy_paged.flash_attn_with_kvcache, torch), mfau._pad_input, mfau._unpad_input)


_INDEX_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table")


class _HostInts:
    """The host values of the 0-d tensors transformers passes as ``max_seqlen_q`` / ``max_seqlen_k``
    (on the GPU in its padding-free path): each read once (one device sync) and reused while the same
    tensor comes back unchanged -- the same tensor for q and k, and for every layer of a forward --
    instead of a sync per name per layer."""

    KEPT = 4

    def __init__(self):
        self._seen: tuple = ()  # (weak reference, version, value), most recent last

    def __call__(self, tensor) -> int:
        try:
            version = tensor._version
        except RuntimeError:  # an inference-mode tensor keeps no version counter: read it every time
            return int(tensor.item())
        for ref, seen_version, value in self._seen:
            if ref() is tensor and version == seen_version:
                return value
        value = int(tensor.item())
        self._seen = (*self._seen[-(self.KEPT - 1):], (weakref.ref(tensor), version, value))
        return value


def _adapted(fn, torch):
    """``fn`` as transformers calls it.  transformers reads the signature to pick the keywords it
    passes and would drop attention sinks silently were ``s_aux`` absent: here it is present, and a
    sink given raises.  Keyword ``max_seqlen_q`` / ``max_seqlen_k`` given as 0-d tensors become
    ints (read once per tensor, :class:`_HostInts`), keyword index tensors of int64 become int32
    (cupy_paged's device kernels read int32)."""
    signature = inspect.signature(fn)
    host_int = _HostInts()

    @functools.wraps(fn)
    def call(*args, s_aux=None, **kwargs):
        if s_aux is not None:
            raise NotImplementedError(
                f"cupy_paged's {fn.__name__} has no attention sinks (transformers passed s_aux); "
                "use another attn_implementation for this model")
        for name in ("max_seqlen_q", "max_seqlen_k"):
            if name in kwargs and isinstance(kwargs[name], torch.Tensor):
                kwargs[name] = host_int(kwargs[name])
        for name in _INDEX_KEYWORDS:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dtype == torch.int64:
                kwargs[name] = value.to(torch.int32)
        return fn(*args, **kwargs)

    sink = inspect.Parameter("s_aux", inspect.Parameter.KEYWORD_ONLY, default=None)
    call.__signature__ = signature.replace(parameters=[*signature.parameters.values(), sink])
    del call.__wrapped__  # inspect.signature reads __signature__ rather than following to fn
    return call
