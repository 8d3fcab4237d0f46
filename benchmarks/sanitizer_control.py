"""A control for the sanitizer runs of tests/test_hf_integration.py: the framework's own kernels
alone (torch's bf16 GEMM through cuBLAS, SDPA through cuDNN and through its flash backend), no
cupy_paged imported, run under a compute-sanitizer tool.  Where one of these fails under a tool
as it fails inside the integration tests, the failure is the tool's with that vendor kernel, not
cupy_paged's.  Prints one line per step: "ok" or the exception.

    compute-sanitizer --tool racecheck --kernel-name regex=paged_decode python3 benchmarks/sanitizer_control.py
"""
import sys


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    x = torch.randn(700, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, 8, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    steps = {"cublas_bf16_linear": lambda: F.linear(x, w),
             "sdpa_cudnn": lambda: _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION, sdpa_kernel),
             "sdpa_flash": lambda: _sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, sdpa_kernel)}
    failed = 0
    for name, step in steps.items():
        try:
            step()
            torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)
        except Exception as error:  # noqa: BLE001 -- a control reports every failure and goes on
            failed += 1
            print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
            if "illegal" in str(error) or "CUDA error" in str(error):
                break  # the context is lost after a device fault: later steps say nothing
    sys.exit(1 if failed else 0)


def _sdpa(q, k, v, backend, sdpa_kernel):
    import torch.nn.functional as F

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


if __name__ == "__main__":
    main()
