"""W8A8 on CUDA, per linear: bfloat16 F.linear against ops.int8_linear (per-token int8
activations, torch._int_mm, scales) and torch._int_mm alone, on Llama-8B-sized shapes. CUDA
events, the mean of 50 calls after 5 warm-ups. Needs a CUDA GPU:

    PYTHONPATH=. python benchmarks/cuda_int8_linear.py
"""

import torch
import torch.nn.functional as F

from kvserve.ops.torch_ops import TorchOps
from kvserve.quant.rtn import quantize_int8


def cuda_us(fn, *args, n: int = 50) -> float:
    """fn(*args)'s mean CUDA time in microseconds over n calls, after 5 warm-ups."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(n):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def main() -> None:
    ops = TorchOps()
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda") * 0.02
        q, s = (t.cuda() for t in quantize_int8(w.cpu()))
        wb = w.bfloat16()
        for m in (1, 16, 128, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx = torch.randint(-127, 127, (max(m, 17), k), dtype=torch.int8, device="cuda")
            print(f"N={n} K={k} M={m}: bf16 {cuda_us(F.linear, x, wb):.1f} us, "
                  f"int8_linear {cuda_us(ops.int8_linear, x, q, s):.1f} us, "
                  f"_int_mm alone {cuda_us(torch._int_mm, qx, q.t()):.1f} us")


if __name__ == "__main__":
    main()
