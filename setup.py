"""Builds primemoe and its CUDA extension primemoe._C against the installed torch.

Environment:
  PRIMEMOE_CUDA_ARCHS  semicolon list of SM targets, default "90a" (e.g. "90a;100a")
  PRIMEMOE_BUILD_JOBS  parallel compile jobs (ninja), default: all cores
  CUDA_HOME            CUDA toolkit root; found from nvcc when unset
Install with `pip install --no-build-isolation .` so the build sees the torch it runs with.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "third_party"))
import locate  # noqa: E402  (third_party/locate.py: where headers and libraries come from)

locate.set_cuda_home()

from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

VERSION = "0.1.0"


def cuda_archs():
    archs = [a.strip() for a in os.environ.get("PRIMEMOE_CUDA_ARCHS", "90a").split(";") if a.strip()]
    supported = {"90a", "100a"}
    bad = [a for a in archs if a not in supported]
    if bad or not archs:
        raise SystemExit(f"PRIMEMOE_CUDA_ARCHS: expected entries from {sorted(supported)}, got {archs}")
    return archs


def local_version(archs):
    import torch

    cuda = (torch.version.cuda or "cpu").replace(".", "")
    torch_ver = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"{VERSION}+cu{cuda}.torch{torch_ver}.sm{'.sm'.join(archs)}"


def extension(archs):
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    nvshmem = locate.nvshmem_root()
    includes = [str(ROOT / "csrc"), locate.cutlass_include(), str(nvshmem / "include")]
    # After the toolkit's own headers, so only what the toolkit lacks comes from there.
    late_includes = [f"-idirafter{d}" for d in locate.cuda_library_includes()]
    sources = ["csrc/binding.cpp"] + sorted(
        str(p.relative_to(ROOT)) for d in ("kernels", "runtime") for p in (ROOT / "csrc" / d).glob("*.cu"))
    nvshmem_lib = str(nvshmem / "lib")
    return CUDAExtension(
        name="primemoe._C",
        sources=sources,
        include_dirs=includes,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20", "-DNDEBUG", *late_includes],
            # -DNDEBUG also keeps ptxas from serialising wgmma in CUTLASS code.
            # -rdc: the NVSHMEM device library is linked in at the device-link step.
            "nvcc": ["-O3", "-std=c++20", "-DNDEBUG", "-lineinfo", "--expt-relaxed-constexpr", "-rdc=true", *gencode,
                     # torch disables the half/bf16 operators by default; NVSHMEM's device headers need them.
                     *[f"-U__CUDA_NO_{k}__" for k in ("HALF_OPERATORS", "HALF_CONVERSIONS", "BFLOAT16_CONVERSIONS",
                                                       "HALF2_OPERATORS")]],
            "nvcc_dlink": ["-dlink", *gencode, f"-L{nvshmem_lib}", "-lnvshmem_device"],
        },
        # pip's NVSHMEM ships only the versioned host library; the rpath finds it beside
        # torch's (site-packages/nvidia/nvshmem/lib) when torch has not loaded it already.
        extra_link_args=[f"-L{nvshmem_lib}", "-l:libnvshmem_device.a", "-l:libnvshmem_host.so.3", "-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib"],
    )


class Build(BuildExtension):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, use_ninja=shutil.which("ninja") is not None, **kwargs)

    def build_extensions(self):
        jobs = os.environ.get("PRIMEMOE_BUILD_JOBS")
        if jobs:
            os.environ["MAX_JOBS"] = jobs
        print(f"primemoe: building for sm_{', sm_'.join(ARCHS)} with CUDA at {os.environ.get('CUDA_HOME')}", flush=True)
        super().build_extensions()


ARCHS = cuda_archs()

setup(
    version=local_version(ARCHS),
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[extension(ARCHS)],
    cmdclass={"build_ext": Build},
)
