"""The public functions, one module each, with their argument preparation (``prepare_*``).

A call is read and checked here, then runs on the CPU backend (``reference``) or through
the CUDA launch glue (``kernels``)."""
