"""Drop-ins for other frameworks, the package's top layer: each imports the public API of
``cupy_paged`` and its framework only inside itself, so ``import cupy_paged`` imports none of them.

* :mod:`cupy_paged.integrations.transformers` -- Hugging Face transformers' ``flash_attention_2``
  and continuous-batching ``paged|flash_attention_2`` paths on cupy_paged (``install()``).
"""
