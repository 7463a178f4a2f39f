"""The torch-free build (CMakeLists.txt) and the C API (csrc/capi), on a CPU-only machine: configure and build the C
API with CMake, install it to a temporary prefix, build a plain C program against the installed package
(find_package(primemoe CONFIG), and pkg-config), and run it: the version, the status strings and the argument
checks, which answer before any CUDA call (there is no GPU or driver here).

CI time: the build is kept small (-DPRIMEMOE_BUILD_GEMM=OFF: the GEMM engine alone takes ~10 min on 2 cores; the
C API's GEMM calls then validate their arguments and answer NOT_SUPPORTED), one architecture (90a), so the whole
module takes about a minute. Skipped, with the reason, where cmake (>= 3.25), nvcc or a C compiler is missing.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "capi" / "primemoe_capi.h"
CONSUMER = ROOT / "tests" / "capi"
BUILD_TIMEOUT_S = 1200


def _cmake():
    cmake = shutil.which("cmake")
    if cmake is None:
        return None, "cmake not found (install CMake >= 3.25, e.g. pip install cmake)"
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"cmake version (\d+)\.(\d+)", out)
    if m is None or (int(m.group(1)), int(m.group(2))) < (3, 25):
        return None, f"cmake >= 3.25 needed, found: {out.splitlines()[0] if out else '?'}"
    return cmake, ""


def _nvcc():
    sys.path.insert(0, str(ROOT / "third_party"))
    saved = os.environ.get("CUDA_HOME")
    try:
        import locate

        locate.set_cuda_home()  # resolves an nvcc wrapper script to the toolkit behind it
        nvcc = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
    except SystemExit as e:  # locate.py reports a missing toolkit with SystemExit
        return None, f"no CUDA toolkit: {e}"
    finally:
        sys.path.pop(0)
        if saved is None:
            os.environ.pop("CUDA_HOME", None)
    return (str(nvcc), "") if nvcc.exists() else (None, f"no nvcc at {nvcc}")


CMAKE, CMAKE_WHY = _cmake()
NVCC, NVCC_WHY = _nvcc()
CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = [
    pytest.mark.skipif(CMAKE is None, reason=CMAKE_WHY),
    pytest.mark.skipif(NVCC is None, reason=NVCC_WHY),
    pytest.mark.skipif(CC is None, reason="no C compiler (cc / gcc)"),
]


def _generator():
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else ["-G", "Unix Makefiles"]


def _run(cmd, **kw):
    """Runs cmd; on failure the assertion shows the command and its output's tail."""
    t0 = time.monotonic()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kw)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{out[-6000:]}"
    print(f"[{time.monotonic() - t0:6.1f} s] {' '.join(map(str, cmd))[:160]}")
    return out


def _header_version():
    text = HEADER.read_text()
    parts = [int(re.search(rf"#define PRIMEMOE_CAPI_VERSION_{p} (\d+)", text).group(1)) for p in ("MAJOR", "MINOR", "PATCH")]
    return tuple(parts)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Configure, build (C API + kernels, sm_90a) and install; returns the install prefix."""
    base = tmp_path_factory.mktemp("capi")
    build, prefix = base / "build", base / "prefix"
    _run([CMAKE, "-S", ROOT, "-B", build, *_generator(), f"-DCMAKE_CUDA_COMPILER={NVCC}",
          "-DCMAKE_CUDA_ARCHITECTURES=90a", "-DCMAKE_BUILD_TYPE=Release", "-DPRIMEMOE_BUILD_GEMM=OFF",
          "-DPRIMEMOE_BUILD_EP=OFF", f"-DPython3_EXECUTABLE={sys.executable}"])
    _run([CMAKE, "--build", build, "--parallel", str(os.cpu_count() or 2)])
    _run([CMAKE, "--install", build, "--prefix", prefix])
    return prefix


def test_installed_layout(installed):
    major, minor, patch = _header_version()
    lib = installed / "lib"
    for rel in ("include/primemoe/capi/primemoe_capi.h", "include/primemoe/kernels/dispatch_layout.cuh",
                "include/primemoe/kernels/row_ops.cuh", "include/primemoe/kernels/quantize.cuh",
                "include/primemoe/gemm/grouped_gemm.cuh", "include/primemoe/gemm/fp8_gemm.cuh",
                "lib/libprimemoe_kernels.a", f"lib/libprimemoe_capi.so.{major}.{minor}.{patch}",
                "lib/cmake/primemoe/primemoe-config.cmake", "lib/cmake/primemoe/primemoe-config-version.cmake",
                "lib/cmake/primemoe/primemoe-targets.cmake", "lib/pkgconfig/primemoe_capi.pc"):
        assert (installed / rel).exists(), rel
    assert (lib / "libprimemoe_capi.so").resolve().name == f"libprimemoe_capi.so.{major}.{minor}.{patch}"
    # The engine's internals (CUTLASS code) are not installed, nor the EP runtime when it is not built.
    assert not (installed / "include/primemoe/gemm/sm90").exists()
    assert not (installed / "include/primemoe/runtime").exists()
    config_version = (installed / "lib/cmake/primemoe/primemoe-config-version.cmake").read_text()
    setup_version = re.search(r'VERSION = "([\d.]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert f'PACKAGE_VERSION "{setup_version}"' in config_version, "CMake's project VERSION must equal setup.py's"


def test_library_exports_only_the_c_api_and_needs_no_driver(installed):
    so = installed / "lib" / "libprimemoe_capi.so"
    nm = shutil.which("nm")
    if nm:
        functions = [line.split()[-1] for line in _run([nm, "-D", "--defined-only", so]).splitlines() if line.strip()]
        assert functions and all(s.startswith("primemoe_") for s in functions), functions
        assert "primemoe_capi_version" in functions and "primemoe_grouped_gemm" in functions
    readelf = shutil.which("readelf")
    if readelf:
        needed = re.findall(r"\(NEEDED\).*\[(.+)\]", _run([readelf, "-d", so]))
        assert not any(n.startswith("libcuda.so") for n in needed), needed  # the runtime is linked in, no driver
        assert f"libprimemoe_capi.so.{_header_version()[0]}" in _run([readelf, "-d", so])  # soname = major


def _check_smoke_output(out):
    major, minor, patch = _header_version()
    assert f"primemoe_capi_version {major * 10000 + minor * 100 + patch}" in out, out
    features = int(re.search(r"primemoe_capi_features (\d+)", out).group(1))
    assert features == 2, f"built for 90a without the GEMM engine: FEATURE_SM90A only, got {features}"
    assert "PASSED: 0 failure(s)" in out, out
    assert "FAIL" not in out.replace("FAILED", ""), out


def test_c_program_via_find_package(installed, tmp_path):
    """tests/capi/: a C-only CMake project, find_package(primemoe CONFIG COMPONENTS capi), no CUDA language."""
    build = tmp_path / "consumer"
    _run([CMAKE, "-S", CONSUMER, "-B", build, *_generator(), f"-DCMAKE_PREFIX_PATH={installed}",
          f"-DCMAKE_C_COMPILER={CC}"])
    _run([CMAKE, "--build", build])
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")}
    out = _run([build / "capi_smoke"], env=env)  # found through the build tree's rpath
    print(out)
    _check_smoke_output(out)


def test_c_program_via_pkg_config(installed, tmp_path):
    """The same program built without CMake (a setuptools / Bazel / JAX FFI build): flags from primemoe_capi.pc."""
    pc_dir = installed / "lib" / "pkgconfig"
    pkg_config = shutil.which("pkg-config")
    if pkg_config:
        env = {**os.environ, "PKG_CONFIG_PATH": str(pc_dir)}
        version = _run([pkg_config, "--modversion", "primemoe_capi"], env=env).strip()
        assert version == ".".join(map(str, _header_version()))
        flags = _run([pkg_config, "--cflags", "--libs", "primemoe_capi"], env=env).split()
    else:  # the .pc file's content, by hand
        flags = [f"-I{installed}/include/primemoe/capi", f"-L{installed}/lib", "-lprimemoe_capi"]
    exe = tmp_path / "capi_smoke_pc"
    _run([CC, "-std=c99", "-Wall", "-Wextra", "-Werror", CONSUMER / "capi_smoke.c", "-o", exe, *flags,
          f"-Wl,-rpath,{installed / 'lib'}"])
    _check_smoke_output(_run([exe]))


@pytest.mark.parametrize("archs, expected", [("90a", "ON"), ("90a-real", "ON"), ("80;90a;100a", "ON"),
                                             ("90", "OFF"), ("90-real;100a", "OFF"), ("", "OFF")])
def test_sm90a_define_only_with_90a(archs, expected, tmp_path):
    """PRIMEMOE_HAVE_SM90A (the GEMM engine's kernels) is defined exactly when 90a is among the architectures."""
    script = tmp_path / "check.cmake"
    script.write_text(f'include("{ROOT}/cmake/primemoe_helpers.cmake")\n'
                      f'primemoe_has_sm90a(have "{archs}")\nmessage("have=${{have}}")\n')
    assert f"have={expected}" in _run([CMAKE, "-P", script])


def test_capi_version_from_header(tmp_path):
    script = tmp_path / "version.cmake"
    script.write_text(f'include("{ROOT}/cmake/primemoe_helpers.cmake")\n'
                      f'primemoe_capi_version(v major "{HEADER}")\nmessage("v=${{v}} major=${{major}}")\n')
    major, minor, patch = _header_version()
    assert f"v={major}.{minor}.{patch} major={major}" in _run([CMAKE, "-P", script])
