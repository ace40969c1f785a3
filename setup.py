"""Build torch-pymem: the pymem._C extension (always) and libpymem_cuda.so (when a CUDA toolkit is found).

Install with the torch you already have:  pip install --no-build-isolation -e .
(Build isolation would fetch a second, multi-GB torch into a throwaway environment.)
"""
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "torch-pymem builds against the torch already installed, and none was found.\n"
        "Install torch first (e.g. `pip install torch`), then `pip install --no-build-isolation .`"
    )

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = ["arena.cpp", "compact.cpp", "history.cpp", "region.cpp", "free_index.cpp", "placement.cpp", "step_placement.cpp", "window.cpp", "backing.cpp", "move_plan.cpp"]
EXT_SOURCES = CORE + ["bench.cpp", "bindings_arena.cpp", "allocator_install.cpp", "hook_cpu.cpp", "hook_budget.cpp", "hook_pluggable.cpp", "storage.cpp", "intercept.cpp", "record.cpp", "recipe.cpp", "runtime_state.cpp", "runtime_lock.cpp", "step_trace.cpp", "step_plan.cpp", "plan_choice.cpp", "plan_cover.cpp", "host_pool.cpp", "host_pool_py.cpp", "sweep.cpp", "movable.cpp", "neighbourhood.cpp", "release_scan.cpp", "fast_op.cpp", "bindings.cpp"]
CUDA_LIB_SOURCES = CORE + ["cuda_table.cpp", "cuda_lib.cpp"]
CXXFLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def find_cuda_home():
    """The CUDA toolkit to compile libpymem_cuda.so against, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    return None


class BuildWithCudaLib(BuildExtension):
    """Builds pymem._C, then the plain C-ABI CUDA library (no libtorch, no link-time cudart)."""

    def run(self):
        super().run()
        if os.environ.get("PYMEM_BUILD_CUDA") == "0":
            print("pymem: PYMEM_BUILD_CUDA=0; building without libpymem_cuda.so (CPU only)")
            return
        cuda_home = find_cuda_home()
        if cuda_home is None:
            print("pymem: no CUDA toolkit found; building without libpymem_cuda.so (CPU only)")
            return
        out_dir = os.path.join(HERE, "pymem") if self.inplace else os.path.join(self.build_lib, "pymem")
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, "libpymem_cuda.so")
        cxx = os.environ.get("CXX", "c++")
        cmd = [cxx, *CXXFLAGS, "-fPIC", "-shared", "-DPYMEM_HAVE_CUDA_HEADERS",
               "-I" + os.path.join(cuda_home, "include"),
               *[os.path.join(HERE, "csrc", s) for s in CUDA_LIB_SOURCES], "-ldl", "-pthread", "-o", out]
        print("pymem: building libpymem_cuda.so against", cuda_home)
        subprocess.check_call(cmd)


# The startup hook (pymem/_startup.py): one line Python runs at every start. It costs one environment
# lookup, and imports pymem (and torch) only when PYMEM_BUDGET is set.
STARTUP_PTH = "torch_pymem_startup.pth"
STARTUP_LINE = "import os; os.environ.get('PYMEM_BUDGET') and __import__('pymem._startup')\n"


def write_startup_pth(directory):
    with open(os.path.join(directory, STARTUP_PTH), "w", encoding="utf-8") as f:
        f.write(STARTUP_LINE)


class BuildPyWithStartupHook(build_py):
    """Regular wheels: the .pth goes to the root of build_lib, which installs into site-packages."""

    def run(self):
        super().run()
        if not self.editable_mode:
            write_startup_pth(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else outputs + [os.path.join(self.build_lib, STARTUP_PTH)]


class EditableWheelWithStartupHook(editable_wheel):
    """Editable installs (PEP 660) do not install build_lib: the .pth goes into the unpacked wheel
    next to setuptools' own __editable__ .pth, so it lands in site-packages all the same."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        write_startup_pth(unpacked_wheel)
        return result


setup(
    name="torch-pymem",
    version="0.1.0",
    description="Runtime tensor memory manager for PyTorch: a hard memory budget through eviction, "
                "offloading and fragmentation-aware placement.",
    packages=find_packages(include=["pymem", "pymem.*"]),
    package_data={"pymem": ["libpymem_cuda.so"]},
    ext_modules=[
        CppExtension(
            "pymem._C",
            [os.path.join("csrc", s) for s in EXT_SOURCES],
            extra_compile_args=CXXFLAGS,
        )
    ],
    cmdclass={"build_ext": BuildWithCudaLib, "build_py": BuildPyWithStartupHook,
              "editable_wheel": EditableWheelWithStartupHook},
    entry_points={"console_scripts": ["pymem = pymem.cli:main"]},
    python_requires=">=3.9",
    install_requires=["torch", "numpy"],
    # CuPy sharing the budget (pymem/cupy.py). CuPy's wheels are named by CUDA major version; this
    # extra names CUDA 13's: with CUDA 12, install cupy-cuda12x yourself instead.
    extras_require={"cupy": ["cupy-cuda13x"], "bench": ["matplotlib"]},
    zip_safe=False,
)
