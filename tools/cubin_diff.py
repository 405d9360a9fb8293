#!/usr/bin/env python3
"""cubin_diff.py: which kernels' machine code a change touched, without a GPU.

Compiles native/src/cuda files to sm_90 cubins twice, at revision REV and as the working tree has them, from one
fixed path (build/cubin_diff/src: a kernel in an anonymous namespace is named after its file's path), and compares
every kernel's .text section byte for byte. A change that is meant to leave the default kernels alone (a switch
that is off, a test hook) shows them as "same"; sessions 39-41 made this check by hand.

    python3 tools/cubin_diff.py REV [--files attention.cu,rope.cu] [--sass REGEX]

--files: the .cu files under native/src/cuda to compile (default: every one). --sass REGEX: also print the SASS
of the working tree's kernels whose names match REGEX (nvdisasm from PyPI's nvidia-cuda-nvdisasm, downloaded
into build/tools once; the CUDA here has no disassembler). Exit status 0 whatever differs; 2 on a failed build.
"""

import argparse
import io
import re
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "cubin_diff"
NVCC_FLAGS = ["-O3", "-std=c++17", "-arch=sm_90", "-DDFLASH_BUILDING_LIBRARY", '-DDFLASH_CUDA_ARCH_LIST="90"']


def text_sections(data: bytes) -> dict:
    """{section name: bytes} of an ELF64 little-endian file's .text.* sections (one per kernel in a cubin)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = headers[shstrndx][4]

    def name(h):
        start = names_off + h[0]
        return data[start:data.index(b"\0", start)].decode()

    out = {}
    for h in headers:
        n = name(h)
        if n.startswith(".text."):
            out[n] = data[h[4]:h[4] + h[5]]
    return out


def compare(old: dict, new: dict) -> list:
    """[(status, section)]: same / differs / added / removed (both compiled from one path, so a kernel keeps its
    name)."""
    rows = []
    for k in sorted(set(old) | set(new)):
        if k not in new:
            rows.append(("removed", k))
        elif k not in old:
            rows.append(("added", k))
        else:
            rows.append(("same" if old[k] == new[k] else "differs", k))
    return rows


def demangled(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(n[len(".text."):] for n in names), capture_output=True,
                             text=True, check=True).stdout.splitlines()
        return out if len(out) == len(names) else list(names)
    except (OSError, subprocess.CalledProcessError):
        return list(names)


def place_tree(rev):
    """build/cubin_diff/src/native: REV's (git archive) or the working tree's native/ (rev None)."""
    src = WORK / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    if rev is None:
        shutil.copytree(ROOT / "native", src / "native")
    else:
        blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "native"], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(blob.stdout)) as tar:
            tar.extractall(src, filter="data")
    return src


def compile_all(src, files, out_dir):
    out_dir.mkdir(parents=True, exist_ok=True)
    cubins = {}
    for f in files:
        cu = src / "native" / "src" / "cuda" / f
        if not cu.exists():
            cubins[f] = None
            continue
        target = out_dir / (f + ".cubin")
        cmd = ["nvcc", *NVCC_FLAGS, f"-I{src / 'native' / 'include'}", f"-I{src / 'native' / 'src'}", "-cubin",
               str(cu), "-o", str(target)]
        print(f"  nvcc {f} ({out_dir.name})", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            sys.stderr.write(run.stderr)
            raise SystemExit(2)
        cubins[f] = target
    return cubins


def nvdisasm():
    tool = WORK.parent / "tools" / "nvdisasm"
    if tool.exists():
        return tool
    found = shutil.which("nvdisasm")
    if found:
        return Path(found)
    wheel_dir = WORK.parent / "tools" / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir),
                    "nvidia-cuda-nvdisasm"], check=True)
    import zipfile

    wheel = next(wheel_dir.glob("nvidia_cuda_nvdisasm-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith("/bin/nvdisasm"))
        tool.write_bytes(z.read(member))
    tool.chmod(0o755)
    return tool


def print_sass(cubin, pattern):
    sass = subprocess.run([str(nvdisasm()), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    keep = False
    for line in sass.splitlines():
        if line.startswith(".text."):
            keep = re.search(pattern, line) is not None
        if keep:
            print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the revision to compare the working tree with (e.g. HEAD~1, a commit)")
    ap.add_argument("--files", help="comma list of native/src/cuda .cu files (default: all)")
    ap.add_argument("--sass", metavar="REGEX", help="print the working tree's SASS of the kernels matching REGEX")
    args = ap.parse_args(argv)
    files = args.files.split(",") if args.files else sorted(p.name for p in (ROOT / "native/src/cuda").glob("*.cu"))
    old = compile_all(place_tree(args.rev), files, WORK / "rev")
    new = compile_all(place_tree(None), files, WORK / "tree")
    totals = {}
    for f in files:
        a = text_sections(old[f].read_bytes()) if old[f] else {}
        b = text_sections(new[f].read_bytes()) if new[f] else {}
        rows = compare(a, b)
        names = demangled([k for _, k in rows])
        counts = {s: sum(1 for r in rows if r[0] == s) for s in ("same", "differs", "added", "removed")}
        print(f"{f}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
        for (status, _), nice in zip(rows, names):
            totals[status] = totals.get(status, 0) + 1
            if status != "same":
                print(f"  {status:8s} {nice.replace('dflash::cuda::(anonymous namespace)::', '')[:220]}")
    print("kernels: " + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())) + f" (the tree against {args.rev})")
    if args.sass:
        for f in files:
            if new[f]:
                print_sass(new[f], args.sass)


if __name__ == "__main__":
    main()
