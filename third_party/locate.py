"""Where primemoe's build finds its third-party code. Nothing is vendored: every
path below comes from an installed package (see third_party/README.md for pins)."""

import os
import shutil
import sys
from pathlib import Path


def _fail(msg: str):
    raise SystemExit(f"primemoe build: {msg}")


def set_cuda_home() -> None:
    """Point CUDA_HOME at the toolkit root. torch guesses it from the nvcc on PATH,
    which is wrong when that nvcc is a wrapper script outside the toolkit."""
    if os.environ.get("CUDA_HOME"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        try:
            text = real.read_text(errors="ignore")[:4096]
        except OSError:
            text = ""
        for token in text.split():
            if token.endswith("/bin/nvcc"):
                candidates.insert(0, Path(token).parent.parent)
    candidates += [Path("/usr/local/cuda")]
    for c in candidates:
        if (c / "include" / "cuda_runtime.h").exists() and (c / "bin" / "nvcc").exists():
            os.environ["CUDA_HOME"] = str(c)
            return
    _fail("no CUDA toolkit found: set CUDA_HOME to the directory holding bin/nvcc and include/")


def _site_dirs():
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    dirs += [site.getusersitepackages()] if hasattr(site, "getusersitepackages") else []
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return [Path(d) for d in dict.fromkeys(dirs)]


def cutlass_include() -> str:
    """CUTLASS/CuTe headers from the nvidia-cutlass wheel (cutlass_library/source/include)."""
    try:
        import cutlass_library
    except ImportError:
        _fail("CUTLASS headers not found: pip install 'nvidia-cutlass==4.2.0.0'")
    inc = Path(cutlass_library.__file__).parent / "source" / "include"
    if not (inc / "cute" / "tensor.hpp").exists():
        _fail(f"nvidia-cutlass is installed but {inc} has no CuTe headers")
    return str(inc)


def nvshmem_root() -> Path:
    """The NVSHMEM pip package torch depends on (nvidia-nvshmem-cu13 / -cu12)."""
    for d in _site_dirs():
        root = d / "nvidia" / "nvshmem"
        if (root / "include" / "nvshmem.h").exists():
            return root
    _fail("NVSHMEM not found: pip install the nvidia-nvshmem-cu13 version your torch pins")


def cuda_library_includes():
    """cuBLAS/cuSPARSE/... headers that ATen includes; pip CUDA builds of torch ship them
    under nvidia/cu13/include rather than in the toolkit."""
    out = []
    for d in _site_dirs():
        for sub in ("cu13", "cu12"):
            inc = d / "nvidia" / sub / "include"
            if (inc / "cusparse.h").exists():
                out.append(str(inc))
        # CUDA 12 wheels (nvidia-cublas-cu12, nvidia-cusparse-cu12, ...): one include directory per library.
        for lib, header in (("cublas", "cublas_v2.h"), ("cusparse", "cusparse.h"), ("cusolver", "cusolverDn.h"),
                            ("curand", "curand.h"), ("cufft", "cufft.h"), ("nvtx", "nvtx3/nvToolsExt.h")):
            inc = d / "nvidia" / lib / "include"
            if (inc / header).exists():
                out.append(str(inc))
    return out


def nvshmem_distribution():
    """(distribution name, version) of the installed NVSHMEM pip package whose headers and device library the build
    links (nvidia-nvshmem-cu13 or -cu12): the wheel pins exactly that version, since the device library in the
    kernels must equal the host library loaded at run time."""
    from importlib import metadata

    root = nvshmem_root()
    for name in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        files = {str(f) for f in (dist.files or ())}
        if any(f.startswith("nvidia/nvshmem/") for f in files) and (root / "include" / "nvshmem.h").exists():
            return name, dist.version
    _fail("NVSHMEM headers found but no nvidia-nvshmem-cu13/-cu12 distribution owns them: install it with pip")
