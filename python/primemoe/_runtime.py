"""What the running process must match for primemoe._C to work, checked at import before the extension loads: the
CUDA major of torch (a primemoe-cu13 binary against a CUDA 12 torch fails at its first kernel) and the NVSHMEM
package version (the NVSHMEM device library is linked into the kernels; the host library loaded at run time must be
the same version, or the first Buffer crashes). Both are recorded at build time in ``_build_info.py``; a source
tree without one (nothing built through setup.py yet) is not checked."""

from __future__ import annotations

from importlib import metadata

import torch

DISTRIBUTIONS = ("primemoe-cu13", "primemoe-cu12", "primemoe")


def build_info():
    """The generated ``primemoe._build_info`` module, or None."""
    try:
        from . import _build_info
    except ImportError:
        return None
    return _build_info


def installed_nvshmem(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def mismatch(info, torch_cuda, nvshmem_version) -> str:
    """Why this process cannot run the binary ``info`` describes ("" if it can)."""
    if torch_cuda is None:
        return (f"primemoe was built for CUDA {info.CUDA_VERSION} but this torch ({torch.__version__}) has no CUDA: "
                "install a CUDA build of torch")
    major = int(str(torch_cuda).split(".")[0])
    if major != info.CUDA_MAJOR:
        return (f"primemoe-cu{info.CUDA_MAJOR} was built for CUDA {info.CUDA_MAJOR} but this torch "
                f"({torch.__version__}) uses CUDA {torch_cuda}: install primemoe-cu{major} instead")
    if nvshmem_version is None:
        return (f"primemoe needs {info.NVSHMEM_DISTRIBUTION}=={info.NVSHMEM_VERSION} (its kernels link NVSHMEM's "
                f"device library of that version), and it is not installed: pip install "
                f"'{info.NVSHMEM_DISTRIBUTION}=={info.NVSHMEM_VERSION}'")
    if nvshmem_version != info.NVSHMEM_VERSION:
        return (f"primemoe was built against {info.NVSHMEM_DISTRIBUTION}=={info.NVSHMEM_VERSION} but "
                f"{nvshmem_version} is installed: NVSHMEM's device library in the kernels must equal the host "
                f"library loaded at run time; install {info.NVSHMEM_DISTRIBUTION}=={info.NVSHMEM_VERSION}")
    return ""


def check() -> None:
    """Raise ImportError naming what to install when this process does not match the build."""
    info = build_info()
    if info is None:
        return
    why = mismatch(info, torch.version.cuda, installed_nvshmem(info.NVSHMEM_DISTRIBUTION))
    if why:
        raise ImportError(why)


def version() -> str:
    """The installed distribution's version, or the source tree's."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "0.1.0+source"
