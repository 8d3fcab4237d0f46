"""A small Llama serving engine over cupy_paged: the model, its weights, sampling, and an engine
that serves a stream of requests through ``cupy_paged.Scheduler`` (continuous batching, chunked
prefill, prefix caching, preemption).  NumPy arrays run on the CPU reference backend, CuPy
arrays on the CUDA kernels; ``examples/serve_llama.py`` is the command line.

Modules: ``config`` (the shape, HF ``config.json``), ``weights`` (random, safetensors read and
write), ``model`` (the forward pass of one step), ``fused`` (its per-token steps on the GPU as
one kernel each, ``fused.cu``), ``cublas`` (capturable matrix products), ``sampling`` (greedy /
temperature / top-k / top-p with a seed per request), ``timing`` (time by bucket),
``cuda_graphs`` (decode steps replayed as CUDA graphs), ``parallel`` (tensor parallelism),
``engine`` (the serving loop and its statistics).
"""
from .config import CPU_DEFAULT, GPU_DEFAULT, LlamaConfig
from .engine import Engine, EngineStats, GenerationRequest
from .model import LlamaModel
from .sampling import SamplingParams
from .weights import load_checkpoint, random_weights, save_checkpoint

__all__ = ["LlamaConfig", "CPU_DEFAULT", "GPU_DEFAULT", "LlamaModel", "SamplingParams", "Engine",
           "EngineStats", "GenerationRequest", "load_checkpoint", "random_weights", "save_checkpoint"]
