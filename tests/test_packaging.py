"""The wheel carries cuda_src/, and the installed package finds and compiles its kernels."""
import os
import pathlib
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHECK = """
import pathlib, sys
import cupy_paged
from cupy_paged._core import compiler as _compiler
from cupy_paged._core import nvrtc
from cupy_paged.kernels import registry
home = pathlib.Path(cupy_paged.__file__).resolve().parent
assert str(home).startswith(sys.prefix), (home, sys.prefix)
sources = _compiler.source_dir()
assert sources == home / "cuda_src", sources
assert (sources / "common.cuh").is_file()
keys = registry.all_keys()
report = nvrtc.compile_offline(keys[0], "sm_90")
assert report.kernels, report.log
print("installed", cupy_paged.__version__, "with", len(keys), "specializations; compiled", keys[0])
"""


@pytest.mark.slow
def test_wheel_installs_and_compiles(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("cupy_paged-*.whl")
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # Without PYTHONPATH: a checkout on it (its .egg-info) would make pip skip the install.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, env=clean)
    # The fresh environment borrows this one's numpy/cupy/numba (no network in tests), but
    # cupy_paged itself must come from the wheel: run from a folder outside the checkout.
    borrowed = sysconfig.get_paths()["purelib"]
    env = dict(os.environ, PYTHONPATH=borrowed)
    toolkits = sorted(pathlib.Path(borrowed).glob("nvidia/cu1*"))
    if toolkits and "CUDA_PATH" not in env:  # where the borrowed CuPy's NVRTC library lives
        env["CUDA_PATH"] = str(toolkits[-1])
    result = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "installed" in result.stdout
