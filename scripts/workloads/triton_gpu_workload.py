"""Real Triton kernels compiled and run once: autotuned matmul and softmax at several shapes.

Run in a fresh process with TRITON_CACHE_DIR set; prints one JSON line:
{"seconds": time to compile (or load from cache) and run everything, "checksum": ...}.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import torch
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in [(64, 64, 32, 4, 3), (128, 64, 32, 4, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4)]
    ]

    @triton.autotune(configs=configs, key=["M", "N", "K"])
    @triton.jit
    def matmul(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = tl.load(a + rm[:, None] * sam + (k + rk)[None, :] * sak,
                        mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
            y = tl.load(b + (k + rk)[:, None] * sbk + rn[None, :] * sbn,
                        mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(x, y)
        tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(tl.float16),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def softmax(x, y, n_cols, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        v = tl.load(x + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
        v = v - tl.max(v, axis=0)
        e = tl.exp(v)
        tl.store(y + row * stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)

    torch.manual_seed(0)
    start = time.perf_counter()
    checksum = 0.0
    for m, n, k in [(512, 512, 512), (1024, 768, 256), (2048, 1024, 512), (768, 2048, 1024)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))  # noqa: E731, B023  (called at once, in this iteration)
        matmul[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
        checksum += float(c.float().sum())
    for rows, cols in [(1024, 1000), (4096, 512), (256, 4096)]:
        x = torch.randn(rows, cols, device="cuda")
        y = torch.empty_like(x)
        softmax[(rows,)](x, y, cols, x.stride(0), BLOCK=triton.next_power_of_2(cols))
        checksum += float(y.sum())
    torch.cuda.synchronize()
    print(json.dumps({"seconds": round(time.perf_counter() - start, 3), "checksum": round(checksum, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
