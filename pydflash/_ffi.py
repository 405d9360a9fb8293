"""The only module that touches cffi: loads libdflash.so against dflash.h and turns statuses into exceptions.

The library is located and opened on first use (load()), not at import, so config parsing and checkpoint
loading work without a built library.
"""

import functools
import os
import re
from importlib.resources import files
from pathlib import Path

import cffi

_PACKAGE_DIR = Path(__file__).resolve().parent
_DEFINE = re.compile(r"#\s*define\s+(\w+)(?:\s+(.*?))?\s*$")
_INT = re.compile(r"[-+]?(?:0[xX][0-9a-fA-F]+|\d+)[uUlL]*")


class DflashError(RuntimeError):
    """A libdflash call returned a non-zero dflash_status.

    status: the numeric dflash_status; status_name: e.g. "DFLASH_STATUS_CAPACITY"; message: dflash_last_error().
    """

    def __init__(self, status, status_name, message):
        self.status = int(status)
        self.status_name = status_name
        self.message = message
        super().__init__(f"{status_name}: {message}" if message else status_name)


class Library:
    """The opened library: ffi (the cffi FFI), lib (its symbols), path and header it came from."""

    def __init__(self, ffi, lib, path, header):
        self.ffi, self.lib, self.path, self.header = ffi, lib, path, header

    def check(self, status):
        """Raise DflashError for a non-zero status; the message is read now, before any other dflash call."""
        if status != 0:
            # The message first: it is only valid until the next dflash_* call on this thread.
            message = self.ffi.string(self.lib.dflash_last_error()).decode(errors="replace")
            name = self.ffi.string(self.lib.dflash_status_string(status)).decode()
            raise DflashError(status, name, message)


def cdef_source(header_text):
    """dflash.h -> text ffi.cdef accepts, by filtering lines (a C preprocessor would drag in libc's typedefs).

    Drops every preprocessor line and the `extern "C" {` / `}` lines of `#ifdef __cplusplus` blocks; removes
    tokens #defined to nothing (DFLASH_API); substitutes integer macros where they are used (array sizes such
    as DFLASH_MAX_LAYERS) and keeps them as `#define NAME value` lines, which cffi exposes as lib.NAME.
    """
    ints, empty, body = {}, set(), []
    cplusplus_depth = 0  # > 0 inside `#ifdef __cplusplus`; counts nested conditionals to find its #endif
    for line in header_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            directive = stripped[1:].strip()
            if cplusplus_depth:
                if directive.startswith("if"):
                    cplusplus_depth += 1
                elif directive.startswith("endif"):
                    cplusplus_depth -= 1
            elif directive.startswith("ifdef") and directive.split()[1:2] == ["__cplusplus"]:
                cplusplus_depth = 1
            elif m := _DEFINE.match(stripped):
                name, value = m.group(1), (m.group(2) or "").strip()
                if not value:
                    empty.add(name)
                elif _INT.fullmatch(value):
                    ints[name] = re.sub(r"[uUlL]+$", "", value)
                # Other defines (e.g. DFLASH_API's visibility attribute in the library's own build) are not
                # part of the ABI a binding sees.
            continue
        if not cplusplus_depth:
            body.append(line)
    text = "\n".join(body)
    if empty:
        text = re.sub(r"\b(?:%s)\b" % "|".join(map(re.escape, sorted(empty))), "", text)
    if ints:
        text = re.sub(r"\b(%s)\b" % "|".join(map(re.escape, sorted(ints))), lambda m: ints[m.group(1)], text)
    return "".join(f"#define {n} {v}\n" for n, v in ints.items()) + text, ints


def _find_library():
    env = os.environ.get("DFLASH_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise ImportError(f"DFLASH_LIBRARY={env!r} is not a file")
        return env
    # importlib.resources, not __file__, so a future non-filesystem install would still be found.
    bundled = Path(str(files("pydflash").joinpath("lib", "libdflash.so")))
    if bundled.is_file():
        return str(bundled)
    raise ImportError(
        f"libdflash.so not found: set DFLASH_LIBRARY to the path of a built libdflash.so, or install pydflash "
        f"as a wheel so that {bundled} exists")


def _find_header():
    env = os.environ.get("DFLASH_HEADER")
    candidates = [Path(env)] if env else [_PACKAGE_DIR / "include" / "dflash.h",
                                          _PACKAGE_DIR.parent / "native" / "include" / "dflash.h"]
    for path in candidates:
        if path.is_file():
            return str(path)
    raise ImportError("dflash.h not found; looked at " + ", ".join(map(str, candidates))
                      + (" (DFLASH_HEADER)" if env else "; set DFLASH_HEADER to override"))


def make_ffi(header_path=None):
    """(FFI with dflash.h declared, {macro: value}) without opening any library."""
    header_path = header_path or _find_header()
    source, ints = cdef_source(Path(header_path).read_text())
    ffi = cffi.FFI()
    ffi.cdef(source)
    return ffi, ints


@functools.lru_cache(maxsize=None)
def load():
    """Open libdflash once per process; raises ImportError when it is missing or its ABI differs."""
    header = _find_header()
    ffi, ints = make_ffi(header)
    path = _find_library()
    lib = ffi.dlopen(path)
    expected, actual = int(ints["DFLASH_ABI_VERSION"], 0), int(lib.dflash_abi_version())
    if actual != expected:
        raise ImportError(f"{path} has ABI version {actual} but {header} declares DFLASH_ABI_VERSION "
                          f"{expected}; rebuild the library or point DFLASH_LIBRARY/DFLASH_HEADER at a matching pair")
    return Library(ffi, lib, path, header)


def check(status):
    """Raise DflashError if status is non-zero."""
    if status != 0:
        load().check(status)
