"""A control for the sanitizer runs of tests/test_hf_integration.py: the framework's own kernels
alone (torch's bf16 GEMM through cuBLAS, SDPA through cuDNN and through its flash backend), no
cupy_paged imported, run under a compute-sanitizer tool; ``engine``: the example engine's own
cuBLAS product (``examples/llama/cublas.py``, cublasGemmEx on CuPy arrays) in float32 and bfloat16,
for tests/test_llama_engine.py.  Where one of these fails under a tool as it fails inside the
tests, the failure is the tool's with that vendor kernel, not cupy_paged's.  Each mode also copies
to the host what a framework kernel wrote (``*_read`` steps; a CuPy elementwise kernel's output as
the comparison), for initcheck, which reports a copy of memory it did not see written.  Prints
"step NAME" before each step and "ok" or the exception after it, so that a tool's reports fall
between the lines of the step that caused them.

    compute-sanitizer --tool racecheck --kernel-name regex=paged_decode python3 benchmarks/sanitizer_control.py [torch|engine]
"""
import pathlib
import sys


def main():
    if sys.argv[1:] == ["engine"]:
        return run(engine_steps(), lambda: __import__("cupy").cuda.runtime.deviceSynchronize())
    if sys.argv[1:] not in ([], ["torch"]):
        raise SystemExit("usage: sanitizer_control.py [torch|engine]")
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    x = torch.randn(700, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    x32, w32 = x.float(), w.float()
    q, k, v = (torch.randn(1, 8, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q1 = q[:, :, -1:].contiguous()  # one new token against 700 keys, as a decode step of generate
    steps = {"sdpa_cudnn": lambda: _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION, sdpa_kernel),
             "sdpa_cudnn_one_token": lambda: _sdpa(q1, k, v, SDPBackend.CUDNN_ATTENTION, sdpa_kernel, False),
             "sdpa_flash": lambda: _sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, sdpa_kernel),
             "torch_cumsum_read": lambda: torch.arange(10, device="cuda").cumsum(0).cpu(),
             "cublas_f32_linear_read": lambda: F.linear(x32, w32).cpu(),
             "cublas_bf16_linear": lambda: F.linear(x, w)}  # last: a fault here ends the context
    run(steps, torch.cuda.synchronize)


def engine_steps() -> dict:
    import cupy
    import ml_dtypes

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from llama.cublas import Gemm

    gemm, rng = Gemm(), cupy.random.default_rng(0)
    a, b = rng.standard_normal((700, 512), dtype=cupy.float32), rng.standard_normal((512, 128), dtype=cupy.float32)
    bf16 = ml_dtypes.bfloat16
    a16, b16 = (cupy.asarray(x.get().astype(bf16)) for x in (a, b))
    def in_graph(product):  # captured on a stream of its own, replayed once, then read
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                out = product()
            finally:
                graph = stream.end_capture()
            graph.launch(stream=stream)
            stream.synchronize()
        return out.get()

    return {"cupy_elementwise_read": lambda: (a * 2).get(), "engine_gemm_f32_read": lambda: gemm(a, b).get(),
            "cupy_elementwise_in_graph_read": lambda: in_graph(lambda: a * 2),
            "engine_gemm_f32_in_graph_read": lambda: in_graph(lambda: gemm(a, b)),
            "engine_gemm_bf16_in_graph_read": lambda: in_graph(lambda: gemm(a16, b16)),
            "engine_gemm_bf16_read": lambda: gemm(a16, b16).get()}  # last: a fault here ends the context


def run(steps: dict, synchronize) -> None:
    failed = 0
    for name, step in steps.items():
        print(f"step {name}", flush=True)
        try:
            step()
            synchronize()
            print(f"{name}: ok", flush=True)
        except Exception as error:  # noqa: BLE001 -- a control reports every failure and goes on
            failed += 1
            print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
            if "illegal" in str(error) or "CUDA error" in str(error):
                break  # the context is lost after a device fault: later steps say nothing
    sys.exit(1 if failed else 0)


def _sdpa(q, k, v, backend, sdpa_kernel, causal=True):
    import torch.nn.functional as F

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


if __name__ == "__main__":
    main()
