"""The arena tests again, against a torch-free build of the arena with -fsanitize=address,undefined.

The module is compiled here (a few seconds), then the property, window, error and thread tests
run in a subprocess with the sanitizer runtimes preloaded (python itself is not instrumented).
Any ASan or UBSan report fails the run: halt_on_error is set for both.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# setup.py's EXT_SOURCES less the torch side (allocator_install, hook_*, storage): those need libtorch.
SOURCES = ["arena.cpp", "compact.cpp", "history.cpp", "region.cpp", "free_index.cpp", "placement.cpp", "window.cpp", "backing.cpp",
           "bench.cpp", "bindings_arena.cpp", "bindings.cpp"]


def runtime(name):
    out = subprocess.run([os.environ.get("CXX", "c++"), f"-print-file-name={name}"],
                         capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


@pytest.fixture(scope="module")
def asan_module(tmp_path_factory):
    pybind11 = pytest.importorskip("pybind11")
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx) or not runtime("libasan.so") or not runtime("libubsan.so"):
        pytest.skip("no C++ compiler with the ASan/UBSan runtimes")
    out = tmp_path_factory.mktemp("asan") / ("_C_asan" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [cxx, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=all", "-shared", "-fPIC", "-DPYMEM_NO_TORCH", "-DPYMEM_MODULE_NAME=_C_asan",
           "-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"],
           *[os.path.join(ROOT, "csrc", s) for s in SOURCES], "-o", str(out)]
    subprocess.run(cmd, check=True)
    return str(out)


def test_arena_tests_pass_under_asan_and_ubsan(asan_module):
    if shutil.which("nm"):  # the module really is instrumented
        syms = subprocess.run(["nm", "-D", asan_module], capture_output=True, text=True).stdout
        assert "__asan_report" in syms and "__ubsan_handle" in syms
    env = dict(os.environ)
    env["PYMEM_ARENA_MODULE"] = asan_module
    env["LD_PRELOAD"] = runtime("libasan.so") + ":" + runtime("libubsan.so")
    # Python's own allocations are not ours to judge: leaks off; everything else halts.
    env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=99"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=98"
    tests = ["test_arena_properties.py", "test_window.py", "test_arena_errors.py", "test_threads.py",
             "test_compaction.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                           *[os.path.join(ROOT, "tests", t) for t in tests]],
                          cwd=os.path.join(ROOT, "tests"), env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report
    assert " passed" in proc.stdout and "failed" not in proc.stdout, report
    assert "skipped" not in proc.stdout, report
