"""nccl_m2n's NCCL: the libnccl vLLM makes its communicators with must be the one that
nccl-extensions' m2n runs them on, and new enough for m2n.

vLLM opens libnccl itself (`vllm.utils.nccl.find_nccl_library`: the file `VLLM_NCCL_SO_PATH`
names, else `libnccl.so.2` as the loader finds it) and hands m2n the raw communicator it made
(`m2n_common.comm_ptr`). m2n's loader first loads NCCL through cuda.pathfinder
(`load_nvidia_dynamic_lib("nccl")`: a `libnccl.so.2` this process already holds, on a GPU
machine torch's, else the nvidia-nccl wheel's, ...), and libnccl_m2n.so then links that one.
Two copies share no state: a communicator of one driven by the other crashes, or hangs inside
the first reshard with every trainer rank and server waiting. m2n also needs NCCL >= 2.30.5.
vLLM says both in its import hint and checks neither; `check_m2n_nccl` does, wherever the
backend is chosen (`check`, the job on every rank, `titan-learner serve`), before any
communicator exists.

The trap it catches: a newer NCCL named by `VLLM_NCCL_SO_PATH` in a process where torch has
already loaded its own, older `libnccl.so.2`, which m2n then takes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M2N_MIN_NCCL = (2, 30, 5)
OTHER_BACKENDS = "allowed: nccl, gloo (or auto)"


def _decoded(code: int) -> tuple[int, int, int]:
    """NCCL's `ncclGetVersion` code: X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _dladdr() -> ctypes._CFuncPtr:
    """glibc's `dladdr`: in libc itself since 2.34, in libdl before."""
    for library in (None, ctypes.util.find_library("dl")):
        found = getattr(ctypes.CDLL(library), "dladdr", None)
        if found is not None:
            found.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
            found.restype = ctypes.c_int
            return found
    raise OSError("dladdr is not available here")


def loaded_nccl(so: str) -> tuple[str, tuple[int, int, int]]:
    """The file `so` is loaded from (for a bare soname, the library of that name this process
    already holds, as `dlopen` gives it), and its NCCL version."""
    library = ctypes.CDLL(so)
    get_version = library.ncclGetVersion
    code = ctypes.c_int()
    if get_version(ctypes.byref(code)) != 0:
        raise ValueError(f"{so}: ncclGetVersion failed")
    info = _DlInfo()
    if not _dladdr()(ctypes.cast(get_version, ctypes.c_void_p), ctypes.byref(info)):
        raise OSError(f"{so}: dladdr could not name the file of ncclGetVersion")
    return os.path.realpath(os.fsdecode(info.dli_fname)), _decoded(code.value)


def _named(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def check_m2n_nccl() -> None:
    """Raise ValueError unless vLLM and m2n would use one libnccl, at NCCL >= 2.30.5."""
    from cuda.pathfinder import load_nvidia_dynamic_lib
    from vllm.utils.nccl import find_nccl_library

    try:
        m2n_file, m2n_version = loaded_nccl(load_nvidia_dynamic_lib("nccl").abs_path)
    except Exception as err:  # cuda.pathfinder's not-found errors, a library without NCCL's API
        why = " ".join(str(err).split())  # pathfinder's message spans lines
        raise ValueError(
            f"weight_transfer 'nccl_m2n': nccl-extensions' m2n finds no usable libnccl here "
            f"({type(err).__name__}: {why}); install NCCL >= {_named(M2N_MIN_NCCL)} (the "
            f"nvidia-nccl wheel torch loads), or {OTHER_BACKENDS}"
        ) from None
    so = find_nccl_library()
    vllm_file, vllm_version = loaded_nccl(so)
    chosen = "VLLM_NCCL_SO_PATH" if os.environ.get("VLLM_NCCL_SO_PATH") else "by its soname"
    if vllm_file != m2n_file:
        raise ValueError(
            f"weight_transfer 'nccl_m2n' needs vLLM and nccl-extensions' m2n on one libnccl, "
            f"and here they differ: vLLM opens NCCL {_named(vllm_version)} from {vllm_file} "
            f"({chosen}), while m2n links NCCL {_named(m2n_version)} from {m2n_file} (the "
            f"libnccl.so.2 this process loaded first, torch's on a GPU machine); make them one "
            f"file of NCCL >= {_named(M2N_MIN_NCCL)} (install it as the nvidia-nccl wheel "
            f"torch loads, and point VLLM_NCCL_SO_PATH there or unset it), or {OTHER_BACKENDS}"
        )
    if vllm_version < M2N_MIN_NCCL:
        raise ValueError(
            f"weight_transfer 'nccl_m2n' needs NCCL >= {_named(M2N_MIN_NCCL)}, and the libnccl "
            f"vLLM and m2n use here ({vllm_file}) is NCCL {_named(vllm_version)}; install a "
            f"newer one as the nvidia-nccl wheel torch loads, or {OTHER_BACKENDS}"
        )
