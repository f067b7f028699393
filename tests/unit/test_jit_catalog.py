"""The catalog of JIT caches (``mithrilfs.jitcaches.catalog``) against the tools' own source.

Installed tools (PyTorch 2.13, Triton 3.8) are read where they are: the
variable must be what their code reads.  The others cannot run here (GPU
libraries, packages not installed): their entries are held against the
line of the tool's source, or documentation, that the catalog names, quoted
below as it was read (repository and path in the catalog's ``source``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mithrilfs.jitcaches import catalog, leaks

SITE = Path(importlib.util.find_spec("torch").origin).parent.parent  # found, not imported (seconds)

#: tool -> (file under site-packages, the text that reads the variable)
INSTALLED = {
    "PyTorch Inductor": ("torch/_inductor/runtime/cache_dir_utils.py", 'os.environ.get("TORCHINDUCTOR_CACHE_DIR")'),
    "PyTorch Inductor, precompiled headers": (
        "torch/_inductor/codecache.py", '_HEADER_DIR = os.path.join(default_cache_dir(), "precompiled_headers")'),
    "Triton": ("triton/knobs.py", 'env_str_callable_default("TRITON_CACHE_DIR"'),
    "torch.utils.cpp_extension": ("torch/utils/cpp_extension.py", "os.environ.get('TORCH_EXTENSIONS_DIR')"),
}

#: tool -> the source (or documentation) line the catalog's entry was checked against, as read
READ_ELSEWHERE = {
    "CUDA driver ComputeCache": "CUDA_CACHE_PATH: Specifies the folder where the just-in-time compiler caches "
                                "binary codes; the default values are ... ~/.nv/ComputeCache on Linux",
    "vLLM": '"VLLM_CACHE_ROOT": lambda: os.path.expanduser(os.getenv("VLLM_CACHE_ROOT", '
            'os.path.join(get_default_cache_root(), "vllm")))',
    "DeepGEMM (alone, under SGLang, under vLLM)": 'os.environ["DG_JIT_CACHE_DIR"] = os.getenv("SGL_DG_CACHE_DIR", ...)'
                                                  ' / SGLANG_DG_CACHE_DIR = EnvStr(...); DG_JIT_CACHE_DIR overrides '
                                                  '$HOME/.deep_gemm',
    "SGLang": 'SGLANG_CACHE_DIR = EnvStr(os.path.expanduser("~/.cache/sglang"))',
    "FlashInfer": 'FLASHINFER_BASE_DIR = Path(os.getenv("FLASHINFER_WORKSPACE_BASE", Path.home().as_posix()))',
    "TensorRT-LLM DeepGEMM (inside FlashInfer)": 'getenv("TRTLLM_DG_CACHE_DIR"), else $HOME/.tensorrt_llm',
    "JAX": "jax_compilation_cache_dir = string_flag(...); each flag reads os.getenv(name.upper(), default): "
           "JAX_COMPILATION_CACHE_DIR",
    "CuPy": "def get_cache_dir(): return os.environ.get('CUPY_CACHE_DIR', _default_cache_dir)",
    "Numba": "NUMBA_CACHE_DIR: If set, override the location of the cache directory",
    "Apache TVM FFI (SGLang, TileLang)": 'cache_dir = os.environ.get("TVM_FFI_CACHE_DIR", '
                                         'str(Path("~/.cache/tvm-ffi").expanduser()))',
}


def test_every_entry_is_checked_once():
    tools = [c.tool for c in catalog.CATALOG]
    assert len(set(tools)) == len(tools)
    assert set(tools) == set(INSTALLED) | set(READ_ELSEWHERE)
    subdirs = [c.subdir for c in catalog.CATALOG]
    assert len(set(subdirs)) == len(subdirs) and ".mithrilfs" not in subdirs


@pytest.mark.parametrize("tool", sorted(INSTALLED))
def test_installed_tools_read_the_variable_the_catalog_sets(tool: str):
    path, text = INSTALLED[tool]
    entry = next(c for c in catalog.CATALOG if c.tool == tool)
    assert text in (SITE / path).read_text(), f"{path} no longer says {text!r}"
    assert path.split("/", 1)[1] in entry.source or path in entry.source
    for var in entry.variables:
        assert var in text
    assert bool(entry.variables) != (entry is catalog.HEADERS)  # the headers alone have no variable


@pytest.mark.parametrize("tool", sorted(READ_ELSEWHERE))
def test_other_tools_entries_match_the_line_they_were_read_from(tool: str):
    entry = next(c for c in catalog.CATALOG if c.tool == tool)
    for var in entry.variables:
        assert var in READ_ELSEWHERE[tool], var
    assert entry.source and entry.verified


def test_the_headers_link_is_where_torch_looks(tmp_path: Path):
    """``headers_link`` against torch's own ``default_cache_dir``, for several environments (one
    process: its temporary directory is found again for each, as a new process would)."""
    probe = ("import json, os, sys, tempfile; from torch._inductor.runtime.cache_dir_utils import default_cache_dir\n"
             "for env in json.loads(sys.argv[1]):\n"
             "    os.environ.clear(); os.environ.update(env); tempfile.tempdir = None\n"
             "    print(os.path.join(default_cache_dir(), 'precompiled_headers'))")
    writable, missing = tmp_path / "t", tmp_path / "missing"
    writable.mkdir()
    envs = [{"PATH": os.environ["PATH"], **env} for env in (
        {"TMPDIR": str(writable), "LOGNAME": "a:b/c"}, {"TMPDIR": str(missing), "TEMP": str(writable)},
        {"USER": "u*v", "TMPDIR": ""})]
    torch_says = subprocess.run([sys.executable, "-c", probe, json.dumps(envs)], capture_output=True, text=True,
                                check=True).stdout.split()
    assert [str(catalog.headers_link(env)) for env in envs] == torch_says


def test_leaks_name_what_grew_and_take_the_headers_out_of_inductors_directory(tmp_path: Path):
    env = {"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path), "LOGNAME": "u"}
    before = leaks.measure(env)
    assert not leaks.grown(before, leaks.measure(env), env)
    headers = tmp_path / "torchinductor_u" / "precompiled_headers"
    headers.mkdir(parents=True)
    (headers / "x.h.gch").write_bytes(b"h" * 5000)
    (tmp_path / "torchinductor_u" / "fx").write_bytes(b"f" * 700)
    grew = {path: (n, c.tool) for path, n, c in leaks.grown(before, leaks.measure(env), env)}
    assert grew == {str(headers): (5000, catalog.HEADERS.tool),
                    str(tmp_path / "torchinductor_u"): (700, "PyTorch Inductor")}
