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
    includes = [str(ROOT / "csrc"), locate.cutlass_include(), locate.nvshmem_include()]
    # After the toolkit's own headers, so only what the toolkit lacks comes from there.
    late_includes = [f"-idirafter{d}" for d in locate.cuda_library_includes()]
    sources = ["csrc/binding.cpp"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "kernels").glob("*.cu"))
    return CUDAExtension(
        name="primemoe._C",
        sources=sources,
        include_dirs=includes,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20", "-DNDEBUG", *late_includes],
            # -DNDEBUG also keeps ptxas from serialising wgmma in CUTLASS code.
            "nvcc": ["-O3", "-std=c++20", "-DNDEBUG", "-lineinfo", "--expt-relaxed-constexpr", *gencode],
        },
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
