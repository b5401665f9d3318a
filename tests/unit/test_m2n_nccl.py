"""nccl_m2n's NCCL check (`vllm.m2n_nccl`) against real shared libraries under the real
dynamic loader: each case is a fresh process that first loads one `libnccl.so.2` (as torch
does at import on a GPU machine), then asks which libnccl vLLM (`VLLM_NCCL_SO_PATH`) and m2n
(cuda.pathfinder, as nccl-extensions loads it) would use. The libraries are built here with
the C compiler and export NCCL's `ncclGetVersion`, each answering its own version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("cuda.pathfinder")
ROOT = Path(__file__).resolve().parents[2]
VERSION_SOURCE = "int ncclGetVersion(int *version) {{ *version = {code}; return 0; }}\n"


def built_libnccl(directory: Path, code: int) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here to build the test's libnccl.so.2")
    directory.mkdir()
    source = directory / "version.c"
    source.write_text(VERSION_SOURCE.format(code=code))
    library = directory / "libnccl.so.2"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", library, source],
        check=True,
    )
    return library


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nccl")
    old = built_libnccl(root / "torch", 22803)  # NCCL 2.28.3
    new = built_libnccl(root / "new", 23005)  # NCCL 2.30.5
    link = root / "libnccl-link.so.2"
    link.symlink_to(new)
    return {"old": old, "new": new, "link to new": link}


CHECK = """
import ctypes, sys
if sys.argv[1]:
    ctypes.CDLL(sys.argv[1])  # the libnccl.so.2 torch loads at import on a GPU machine
from titan_learner.vllm.m2n_nccl import check_m2n_nccl
try:
    check_m2n_nccl()
    print("accepted")
except ValueError as err:
    print(err)
"""


def checked(preloaded: Path | None, vllm_nccl_so_path: Path) -> str:
    env = {**os.environ, "VLLM_NCCL_SO_PATH": str(vllm_nccl_so_path), "PYTHONPATH": str(ROOT)}
    env.pop("LD_LIBRARY_PATH", None)
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(preloaded or "")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]  # vLLM's import may log lines before it


def test_one_new_enough_libnccl_for_vllm_and_m2n_is_accepted(libraries):
    assert checked(libraries["new"], libraries["link to new"]) == "accepted"


def test_vllm_on_a_newer_libnccl_than_the_one_m2n_links_is_refused_naming_both(libraries):
    old, new = (os.path.realpath(libraries[k]) for k in ("old", "new"))
    assert checked(libraries["old"], libraries["new"]) == (
        f"weight_transfer 'nccl_m2n' needs vLLM and nccl-extensions' m2n on one libnccl, and "
        f"here they differ: vLLM opens NCCL 2.30.5 from {new} (VLLM_NCCL_SO_PATH), while m2n "
        f"links NCCL 2.28.3 from {old} (the libnccl.so.2 this process loaded first, torch's on "
        f"a GPU machine); make them one file of NCCL >= 2.30.5 (install it as the nvidia-nccl "
        f"wheel torch loads, and point VLLM_NCCL_SO_PATH there or unset it), or allowed: nccl, "
        f"gloo (or auto)"
    )


def test_one_libnccl_older_than_m2n_needs_is_refused_with_its_version(libraries):
    old = os.path.realpath(libraries["old"])
    assert checked(libraries["old"], libraries["old"]) == (
        f"weight_transfer 'nccl_m2n' needs NCCL >= 2.30.5, and the libnccl vLLM and m2n use "
        f"here ({old}) is NCCL 2.28.3; install a newer one as the nvidia-nccl wheel torch "
        f"loads, or allowed: nccl, gloo (or auto)"
    )


def test_no_libnccl_for_m2n_is_refused_before_any_communicator(libraries):
    said = checked(None, libraries["new"])
    assert said.startswith(
        "weight_transfer 'nccl_m2n': nccl-extensions' m2n finds no usable libnccl here "
        "(DynamicLibNotFoundError: "
    )
    assert said.endswith(
        "install NCCL >= 2.30.5 (the nvidia-nccl wheel torch loads), or allowed: nccl, gloo "
        "(or auto)"
    )


@pytest.mark.parametrize(
    ("code", "version"), [(23005, (2, 30, 5)), (22803, (2, 28, 3)), (2708, (2, 7, 8))]
)
def test_nccl_version_codes_decode_before_and_after_2_9(code, version):
    from titan_learner.vllm.m2n_nccl import _decoded

    assert _decoded(code) == version
