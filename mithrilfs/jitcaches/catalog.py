"""Every JIT cache of the stack, and how one mount reaches each of them.

One table (``CATALOG``) says, for each tool, the variable that moves its
cache (or, where there is none, the path the mount reaches by a link), what
the cache holds, where it goes without us, and where that was verified.
``mithrilfs env``, ``mithrilfs run``, the control file ``.mithrilfs/env``
(what an app container beside the sidecar evaluates: it has no mithrilfs
installed) and, through that file, the sidecar's compose file and
Kubernetes manifest all read it, so no list of variables is written twice.

Inductor's precompiled headers are the one cache no variable moves:
``torch/_inductor/codecache.py`` puts them in
``default_cache_dir()/precompiled_headers`` (``$TMPDIR/torchinductor_$USER``),
on purpose outside ``TORCHINDUCTOR_CACHE_DIR``, and rebuilds them (about
147 MB, most of a cold CPU compile's g++ time) when they are missing.
Pointing ``TMPDIR`` at the mount would capture them, and every ordinary
temporary file of the program with them; instead the one directory
``precompiled_headers`` is made a link into the mount (``HEADERS``), by the
same rule torch uses to find it (``headers_link``, and its shell twin in
``shell_env``).  The rest of ``$TMPDIR`` stays local.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CATALOG", "HEADERS", "JitCache", "drop_headers_link", "headers_before", "headers_link", "link_headers",
           "make_dirs", "shell_env", "unlink_headers", "variables"]


@dataclass(frozen=True)
class JitCache:
    """One tool's JIT cache.

    ``subdir`` is where it lives under the mount; ``variables`` are set to
    that directory (empty for a cache reached by a link instead);
    ``defaults`` are where the tool writes without them (``~`` is the home,
    ``$XDG`` the XDG cache home, ``$TMP/$USER`` what torch's
    ``default_cache_dir`` uses): the places a leak shows up in.
    """

    tool: str
    holds: str
    subdir: str
    variables: tuple[str, ...]
    defaults: tuple[str, ...]
    source: str
    verified: str


#: Inductor's precompiled headers: no variable, a link at ``$TMP/torchinductor_$USER/precompiled_headers``.
HEADERS = JitCache(
    "PyTorch Inductor, precompiled headers", "cpp_prefix.h.gch and its .h (about 147 MB per compiler and flags)",
    "inductor-headers", (), ("$TMP/torchinductor_$USER/precompiled_headers",),
    "pytorch torch/_inductor/codecache.py: _HEADER_DIR = os.path.join(default_cache_dir(), 'precompiled_headers')",
    "run: tests/e2e/test_jit_caches.py (a new node compiles nothing)")

CATALOG: tuple[JitCache, ...] = (
    JitCache("PyTorch Inductor", "FX graph and AOT autograd caches, generated C++/Python, kernel .so files",
             "inductor", ("TORCHINDUCTOR_CACHE_DIR",), ("$TMP/torchinductor_$USER",),
             "pytorch torch/_inductor/runtime/cache_dir_utils.py: cache_dir(), default_cache_dir()",
             "run: tests/e2e/test_jit_caches.py"),
    HEADERS,
    JitCache("Triton", "compiled kernels (.cubin/.ptx/.json), launcher .so files, autotune results",
             "triton", ("TRITON_CACHE_DIR",), ("~/.triton/cache",),
             "triton python/triton/knobs.py: cache.dir = env_str_callable_default('TRITON_CACHE_DIR', ...)",
             "run: tests/e2e/test_jit_caches.py"),
    JitCache("torch.utils.cpp_extension", "load()/load_inline() builds: sources, build.ninja, .o, .so",
             "torch_extensions", ("TORCH_EXTENSIONS_DIR",), ("$XDG/torch_extensions",),
             "pytorch torch/utils/cpp_extension.py: _get_build_directory() reads TORCH_EXTENSIONS_DIR",
             "run: tests/e2e/test_jit_caches.py"),
    JitCache("CUDA driver ComputeCache", "SASS the driver JIT-compiled from PTX",
             "cuda", ("CUDA_CACHE_PATH",), ("~/.nv/ComputeCache",),
             "CUDA C++ Programming Guide, CUDA environment variables: CUDA_CACHE_PATH",
             "documentation (needs a GPU)"),
    JitCache("vLLM", "torch_compile_cache (it points Inductor and Triton there), deep_gemm by default",
             "vllm", ("VLLM_CACHE_ROOT",), ("$XDG/vllm",),
             "vllm vllm/envs.py: VLLM_CACHE_ROOT; vllm/compilation/compiler_interface.py initialize_cache",
             "source text (needs a GPU)"),
    JitCache("DeepGEMM (alone, under SGLang, under vLLM)", "JIT-compiled GEMM kernels (kernel.cubin per key)",
             "deep_gemm", ("DG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "SGL_DG_CACHE_DIR"),
             ("~/.deep_gemm", "~/.cache/deep_gemm"),
             "DeepGEMM csrc/jit/compiler.hpp (DG_JIT_CACHE_DIR); sglang python/sglang/srt/environ.py "
             "(SGLANG_DG_CACHE_DIR, older SGL_DG_CACHE_DIR, overwrites DG_JIT_CACHE_DIR)",
             "source text (needs a GPU)"),
    JitCache("SGLang", "its JIT kernels and CuTe DSL AOT objects", "sglang", ("SGLANG_CACHE_DIR",),
             ("~/.cache/sglang",), "sglang python/sglang/srt/environ.py: SGLANG_CACHE_DIR",
             "source text (needs a GPU)"),
    JitCache("FlashInfer", "JIT-built ops (cached_ops/, generated/) under .cache/flashinfer of the base",
             "flashinfer", ("FLASHINFER_WORKSPACE_BASE",), ("~/.cache/flashinfer",),
             "flashinfer flashinfer/jit/env.py: FLASHINFER_BASE_DIR = os.getenv('FLASHINFER_WORKSPACE_BASE', home)",
             "source text (needs a GPU)"),
    JitCache("TensorRT-LLM DeepGEMM (inside FlashInfer)", "JIT-compiled cubins", "tensorrt_llm",
             ("TRTLLM_DG_CACHE_DIR",), ("~/.tensorrt_llm",),
             "flashinfer csrc/nv_internal/tensorrt_llm/deep_gemm/compiler.cuh: getenv('TRTLLM_DG_CACHE_DIR')",
             "source text (needs a GPU)"),
    JitCache("JAX", "the persistent compilation cache (off until a directory is given)", "jax",
             ("JAX_COMPILATION_CACHE_DIR",), (),
             "jax jax/_src/config.py: jax_compilation_cache_dir (each flag reads its NAME.upper() variable)",
             "source text (jax is not installed here)"),
    JitCache("CuPy", "compiled kernels", "cupy", ("CUPY_CACHE_DIR",), ("~/.cupy/kernel_cache",),
             "cupy cupy/cuda/compiler.py: get_cache_dir() reads CUPY_CACHE_DIR", "source text (needs a GPU)"),
    JitCache("Numba", "cache=True functions (.nbi/.nbc)", "numba", ("NUMBA_CACHE_DIR",), (),
             "numba documentation, Environment variables / Caching: NUMBA_CACHE_DIR overrides __pycache__",
             "documentation (numba is not installed here)"),
    JitCache("Apache TVM FFI (SGLang, TileLang)", "C++ extension builds", "tvm-ffi", ("TVM_FFI_CACHE_DIR",),
             ("~/.cache/tvm-ffi",),
             "tvm-ffi python/tvm_ffi/cpp/extension.py: os.environ.get('TVM_FFI_CACHE_DIR', '~/.cache/tvm-ffi')",
             "source text (needs a GPU)"),
)


def variables(mountpoint: Path) -> dict[str, str]:
    """Every variable of the catalog, set to its directory under *mountpoint*."""
    return {var: str(mountpoint / c.subdir) for c in CATALOG for var in c.variables}


def make_dirs(mountpoint: Path) -> None:
    """Every catalog directory under the mount (a program may write into its variable's directory at once)."""
    for c in CATALOG:
        (mountpoint / c.subdir).mkdir(exist_ok=True)


def _user(env: dict[str, str]) -> str:
    """``getpass.getuser()`` as torch's ``default_cache_dir`` sanitizes it."""
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        if env.get(var):
            name = env[var]
            break
    else:
        try:
            name = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:
            name = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", name)


def temp_dir(env: dict[str, str]) -> str:
    """``tempfile.gettempdir()`` for a process given *env*: the first of TMPDIR, TEMP, TMP that is a
    writable directory, else /tmp."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        d = env.get(var)
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return os.path.abspath(d)
    return "/tmp"


def expand(template: str, env: dict[str, str]) -> Path:
    """A catalog path (``~``, ``$XDG``, ``$TMP``, ``$USER``) for a process given *env*."""
    home = env.get("HOME") or os.path.expanduser("~")
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    path = template.replace("$TMP", temp_dir(env)).replace("$USER", _user(env)).replace("$XDG", xdg)
    return Path(home + path[1:] if path.startswith("~") else path)


def headers_link(env: dict[str, str]) -> Path:
    """Where torch looks for its precompiled headers in a process given *env*."""
    return expand(HEADERS.defaults[0], env)


def headers_before(env: dict[str, str]) -> tuple[Path, str | None] | None:
    """What ``link_headers`` would replace in a process given *env*: (the link's path, what a link there
    points to now, or None); None when a real directory is there (a machine that compiled before: its
    headers stay where they are)."""
    link = headers_link(env)
    before = os.readlink(link) if link.is_symlink() else None
    if before is None and os.path.lexists(link):
        return None
    return link, before


def link_headers(mountpoint: Path, env: dict[str, str]) -> tuple[Path, str | None] | None:
    """Make torch's precompiled-header directory a link into the mount.

    Returns (link, what it pointed to before) when a link was made, for
    ``unlink_headers``; None when a real directory is there (``headers_before``).
    """
    make_dirs(mountpoint)  # the target too: a dangling link fails torch.compile (FileExistsError)
    headers_link(env).parent.mkdir(parents=True, exist_ok=True)
    made = headers_before(env)
    if made is None:
        return None
    link, before = made
    target = mountpoint / HEADERS.subdir
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)
    return link, before


def unlink_headers(mountpoint: Path, made: tuple[Path, str | None] | None) -> None:
    """Undo ``link_headers``: a link left to a mount that goes away would fail every later torch.compile."""
    if made is None:
        return
    link, before = made
    if link.is_symlink() and os.readlink(link) == str(mountpoint / HEADERS.subdir):
        if before is None:
            link.unlink()
        else:
            tmp = link.with_name(f".{link.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(before)
            tmp.replace(link)


def drop_headers_link(mountpoint: Path, env: dict[str, str]) -> bool:
    """At ``umount``: the link ``mithrilfs env`` left in this user's temporary directory goes with the mount
    it points into (dangling, it would fail every later torch.compile with FileExistsError)."""
    link = headers_link(env)
    if link.is_symlink() and os.readlink(link) == str(mountpoint / HEADERS.subdir):
        link.unlink()
        return True
    return False


#: The shell twin of ``headers_link`` + ``link_headers`` (POSIX sh; kept to what an app container's shell has).
_SHELL_LINK = r"""
mithrilfs_t=
for mithrilfs_v in "${TMPDIR:-}" "${TEMP:-}" "${TMP:-}"; do
    if [ -n "$mithrilfs_v" ] && [ -d "$mithrilfs_v" ] && [ -w "$mithrilfs_v" ]; then mithrilfs_t=$mithrilfs_v; break; fi
done
mithrilfs_u=${LOGNAME:-${USER:-${LNAME:-${USERNAME:-$(id -un 2>/dev/null || echo "uid_$(id -u)")}}}}
mithrilfs_d=${mithrilfs_t:-/tmp}/torchinductor_$(printf '%s' "$mithrilfs_u" | tr '\\/:*?"<>|' '_________')
if mkdir -p DIRS "$mithrilfs_d" 2>/dev/null && { [ -L "$mithrilfs_d/precompiled_headers" ] || [ ! -e "$mithrilfs_d/precompiled_headers" ]; }; then
    ln -sfn TARGET "$mithrilfs_d/precompiled_headers"
fi
unset mithrilfs_t mithrilfs_v mithrilfs_u mithrilfs_d
"""


def shell_env(mountpoint: Path) -> str:
    """What ``eval "$(mithrilfs env MOUNT)"`` runs: the variables, then the headers' link."""
    lines = [f"export {var}={shlex.quote(value)}" for var, value in variables(mountpoint).items()]
    lines.append("# Inductor's precompiled headers: no variable moves them (docs/design.md); a link does")
    dirs = " ".join(shlex.quote(str(mountpoint / c.subdir)) for c in CATALOG)
    lines.append(_SHELL_LINK.strip().replace("DIRS", dirs).replace("TARGET", shlex.quote(str(mountpoint / HEADERS.subdir))))
    return "\n".join(lines) + "\n"
