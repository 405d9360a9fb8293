"""Builds tests/c/test_abi.c against the installed (or DFLASH_LIBRARY) libdflash and runs it.

The C program drives the whole C ABI on the host backend; here it only has to compile warning-free as strict
C99, link, and print "ALL OK". The header is also compiled as C++17 to show it is usable from C++.

Library: $DFLASH_LIBRARY, else <pydflash package>/lib/libdflash.so.
Header:  $DFLASH_HEADER, else <pydflash package>/include/dflash.h, else <repo>/native/include/dflash.h.
"""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
C_SOURCE = REPO / "tests" / "c" / "test_abi.c"
STRICT_C = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"]
RUN_TIMEOUT_S = 600


def _package_dir():
    spec = importlib.util.find_spec("pydflash")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parent


def _find_library():
    env = os.environ.get("DFLASH_LIBRARY")
    if env:
        path = Path(env)
        if not path.is_file():
            pytest.fail(f"DFLASH_LIBRARY={env!r} is not a file")
        return path.resolve()
    pkg = _package_dir()
    if pkg is not None and (pkg / "lib" / "libdflash.so").is_file():
        return (pkg / "lib" / "libdflash.so").resolve()
    pytest.skip("libdflash.so not found: set DFLASH_LIBRARY to a built libdflash.so or install pydflash "
                f"so that <pydflash>/lib/libdflash.so exists (package dir: {pkg})")


def _find_include_dir():
    env = os.environ.get("DFLASH_HEADER")
    candidates = [Path(env)] if env else []
    pkg = _package_dir()
    if pkg is not None:
        candidates.append(pkg / "include" / "dflash.h")
    candidates.append(REPO / "native" / "include" / "dflash.h")
    for header in candidates:
        if header.is_file():
            return header.resolve().parent
    pytest.fail("dflash.h not found; looked at " + ", ".join(map(str, candidates)))


def _compiler(*names):
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no compiler found (looked for {', '.join(names)} on PATH)")


def _run(cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)


def _show(proc):
    return f"$ {' '.join(map(str, proc.args))}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def test_c_abi_program(tmp_path):
    cc = _compiler("cc", "gcc", "clang")
    library = _find_library()
    include_dir = _find_include_dir()
    libdir = library.parent
    exe = tmp_path / "test_abi"
    if library.name == "libdflash.so":
        link = [f"-L{libdir}", "-ldflash"]
    else:  # an oddly named DFLASH_LIBRARY: link the file itself
        link = [str(library)]
    build = _run([cc, *STRICT_C, f"-I{include_dir}", str(C_SOURCE), "-o", str(exe), *link,
                  f"-Wl,-rpath,{libdir}"])
    assert build.returncode == 0, "test_abi.c did not compile cleanly\n" + _show(build)

    env = dict(os.environ)
    env.setdefault("DFLASH_TEST_VERBOSE", "0")
    try:
        proc = _run([exe], env=env, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"test_abi ran past {RUN_TIMEOUT_S}s\n--- stdout ---\n{e.stdout}\n--- stderr ---\n{e.stderr}")
    print(proc.stdout)
    if proc.stderr:
        print(proc.stderr)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        f"test_abi against {library} failed with exit code {proc.returncode}"
        + (" (killed by a signal: a crash)" if proc.returncode < 0 else "") + "\n" + _show(proc))


def test_header_is_valid_cplusplus(tmp_path):
    cxx = _compiler("c++", "g++", "clang++")
    include_dir = _find_include_dir()
    source = tmp_path / "use_header.cpp"
    source.write_text(
        '#include "dflash.h"\n'
        "#include <cstdint>\n"
        "static_assert(DFLASH_ABI_VERSION >= 1, \"abi\");\n"
        "int main() {\n"
        "    dflash_drafter_params p = dflash_drafter_default_params();\n"
        "    dflash_context *ctx = nullptr;\n"
        "    dflash_context_params cp = dflash_context_default_params();\n"
        "    dflash_status st = dflash_context_create(&cp, &ctx);\n"
        "    (void)p; (void)st;\n"
        "    return dflash_abi_version() == DFLASH_ABI_VERSION ? 0 : 1;\n"
        "}\n")
    proc = _run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic",
                 f"-I{include_dir}", str(source)])
    assert proc.returncode == 0, "dflash.h is not valid C++17\n" + _show(proc)


def test_header_is_valid_c99_alone(tmp_path):
    """The header on its own, first include, strict C99: no hidden dependency on another include."""
    cc = _compiler("cc", "gcc", "clang")
    include_dir = _find_include_dir()
    source = tmp_path / "use_header.c"
    source.write_text('#include "dflash.h"\nint main(void) { return dflash_abi_version() > 0 ? 0 : 1; }\n')
    proc = _run([cc, *STRICT_C, "-fsyntax-only", f"-I{include_dir}", str(source)])
    assert proc.returncode == 0, "dflash.h is not valid strict C99\n" + _show(proc)
