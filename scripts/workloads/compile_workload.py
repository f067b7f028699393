"""One torch.compile of a small MLP in this process; prints a JSON line of what happened.

Run it in a fresh process with TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR)
pointing where the cache should live.  Used by the e2e tests, the demo and
scripts/bench/bench_compile.py, so all three measure the same work.

Output: {"seconds": compile+first call, "fxgraph_cache_hit": N,
"fxgraph_cache_miss": N, "autograd_cache_hit": N, "autograd_cache_miss": N,
"output_sha": digest of the output tensor}.  With MITHRILFS_WORKLOAD_EXTENSION=1
it also builds and loads a ``torch.utils.cpp_extension.load_inline`` module
(into TORCH_EXTENSIONS_DIR) and adds what it computed as "extension".
MITHRILFS_WORKLOAD_MEGACACHE_SAVE=FILE / _LOAD=FILE: PyTorch's Mega-Cache
(``torch.compiler.save_cache_artifacts`` after the compile, ``load_cache_artifacts``
before it), the peer ``scripts/bench/bench_jit_newnode.py`` compares with.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time


def main() -> int:
    # Inductor's in-process caches must not hide the on-disk cache.
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    import torch

    torch.manual_seed(0)
    width = int(os.environ.get("MITHRILFS_WORKLOAD_WIDTH", "64"))
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width * 2),
        torch.nn.GELU(),
        torch.nn.Linear(width * 2, width),
        torch.nn.LayerNorm(width),
    )
    x = torch.randn(8, width)
    device = os.environ.get("MITHRILFS_WORKLOAD_DEVICE", "cpu")  # "cuda": Inductor emits Triton kernels
    model, x = model.to(device), x.to(device)
    start = time.perf_counter()
    if load := os.environ.get("MITHRILFS_WORKLOAD_MEGACACHE_LOAD"):
        with open(load, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    compiled = torch.compile(model)
    with torch.no_grad():
        out = compiled(x)
    seconds = time.perf_counter() - start
    from torch._dynamo.utils import counters

    result = {
        "seconds": round(seconds, 3),
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "output_sha": hashlib.sha256(struct.pack(f"{out.numel()}f", *out.cpu().flatten().tolist())).hexdigest(),
    }
    if save := os.environ.get("MITHRILFS_WORKLOAD_MEGACACHE_SAVE"):
        artifacts = torch.compiler.save_cache_artifacts()
        assert artifacts is not None, "Mega-Cache saved nothing"
        with open(save, "wb") as f:
            f.write(artifacts[0])
    if os.environ.get("MITHRILFS_WORKLOAD_EXTENSION") == "1":
        from torch.utils.cpp_extension import load_inline

        ext = load_inline(name="mithrilfs_workload_ext", cpp_sources="int add3(int a) { return a + 3; }",
                          functions=["add3"])
        result["extension"] = ext.add3(39)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
