"""The cache manager and the scheduler: block pool, prefix cache, KV cache, scheduler.

Plain data in and out (NumPy index arrays, sequence ids, token counts): nothing here
imports the public functions or the kernels."""
