"""Builds primemoe and its CUDA extension primemoe._C against the installed torch.

Environment:
  PRIMEMOE_CUDA_ARCHS  semicolon list of SM targets, default "90a" (e.g. "90a;100a")
  PRIMEMOE_BUILD_JOBS  parallel compile jobs (ninja), default: all cores
  CUDA_HOME            CUDA toolkit root; found from nvcc when unset
Install with `pip install --no-build-isolation .` so the build sees the torch it runs with.
"""

import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "third_party"))
import locate  # noqa: E402  (third_party/locate.py: where headers and libraries come from)

locate.set_cuda_home()

from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

VERSION = "0.1.0"
# The oldest torch the extension loads into: its stable ABI (major << 56 | minor << 48), here 2.10.
TORCH_TARGET_VERSION = "0x020A000000000000ULL"
# The oldest CPython the wheel is for (abi3): the module init uses the limited API only.
PY_LIMITED_API = "cp310"


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
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "binding").glob("*.cpp")) + sorted(
        str(p.relative_to(ROOT)) for d in ("kernels", "runtime") for p in (ROOT / "csrc" / d).glob("*.cu"))
    nvshmem_lib = str(nvshmem / "lib")
    return CUDAExtension(
        name="primemoe._C",
        sources=sources,
        # Python's limited API (3.10, see PY_LIMITED_API) and torch's stable ABI (TORCH_TARGET_VERSION below): one
        # wheel for every CPython >= 3.10 and every torch >= 2.10 (csrc/binding/common.h).
        py_limited_api=True,
        # Relink when the separately compiled engine (see compile_engine) changes.
        depends=[str(p) for p in engine_sources()] + [str(p) for p in (ROOT / "csrc").rglob("*.cuh")],
        include_dirs=includes,
        extra_compile_args={
            # TORCH_TARGET_VERSION: only the stable ABI of torch 2.10 and older is visible to the binding;
            # USE_CUDA: the stable C shim declares its CUDA entry points (the current stream) only then.
            # Hidden visibility, as torch's stable namespace has: the library exports PyInit__C alone.
            "cxx": ["-O3", "-std=c++20", "-DNDEBUG", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}", "-DUSE_CUDA",
                    "-fvisibility=hidden", *late_includes],
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


def engine_sources():
    return sorted(p for d in ("gemm", "gemm/instantiations") for p in (ROOT / "csrc" / d).glob("*.cu"))


def compile_engine(archs, build_temp, jobs):
    """The expert GEMM engine (csrc/gemm) is compiled apart, as whole-program device code: under
    -rdc (which NVSHMEM's device library needs for the rest) ptxas ignores setmaxnreg and
    serialises wgmma. Its objects join the extension at the host link. Returns their paths."""
    nvcc = str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    flags = ["-O3", "-std=c++20", "-DNDEBUG", "-lineinfo", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
             *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs],
             *(["-DPRIMEMOE_HAVE_SM90A"] if "90a" in archs else []),
             f"-I{ROOT / 'csrc'}", f"-I{locate.cutlass_include()}"]
    headers = [p for p in (ROOT / "csrc").rglob("*.cuh")]
    newest_header = max(p.stat().st_mtime for p in headers)
    out_dir = Path(build_temp).resolve() / "engine"
    out_dir.mkdir(parents=True, exist_ok=True)
    todo, objects = [], []
    for src in engine_sources():
        obj = out_dir / (src.relative_to(ROOT / "csrc").as_posix().replace("/", "__") + ".o")
        objects.append(str(obj))
        if not obj.exists() or obj.stat().st_mtime < max(src.stat().st_mtime, newest_header):
            todo.append((src, obj))

    def run(job):
        src, obj = job
        print(f"primemoe: nvcc {src.relative_to(ROOT)}", flush=True)
        subprocess.run([nvcc, *flags, "-c", str(src), "-o", str(obj)], check=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(run, todo))
    return objects


class Build(BuildExtension):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, use_ninja=shutil.which("ninja") is not None, **kwargs)

    def build_extensions(self):
        jobs = os.environ.get("PRIMEMOE_BUILD_JOBS")
        if jobs:
            os.environ["MAX_JOBS"] = jobs
        print(f"primemoe: building for sm_{', sm_'.join(ARCHS)} with CUDA at {os.environ.get('CUDA_HOME')}", flush=True)
        objects = compile_engine(ARCHS, self.build_temp, int(jobs) if jobs else (os.cpu_count() or 1))
        for ext in self.extensions:
            ext.extra_objects = [*ext.extra_objects, *objects]
        super().build_extensions()

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        # A version-specific _C.cpython-*.so left by an earlier (non-abi3) build would shadow _C.abi3.so on import.
        keep = {Path(self.get_ext_filename(ext.name)).name for ext in self.extensions}
        for stale in (ROOT / "python" / "primemoe").glob("_C.*.so"):
            if stale.name not in keep:
                print(f"primemoe: removing {stale.relative_to(ROOT)} (it would shadow the abi3 module)", flush=True)
                stale.unlink()


ARCHS = cuda_archs()

setup(
    version=local_version(ARCHS),
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[extension(ARCHS)],
    cmdclass={"build_ext": Build},
    options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}},
)
