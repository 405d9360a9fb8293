"""tools/bench.py on the CPU (--tiny: tiny shapes on the host backend), so the script every GPU session runs cannot
rot between device runs: the table's rows and the JSON, the end-to-end projection, and --variants' A/B table.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "bench.py")


def _bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, BENCH, "--tiny", "--iters", "2", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def _bench_module():
    """tools/bench.py imported as a module (its helpers, without running it)."""
    import importlib
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        return importlib.import_module("bench")
    finally:
        sys.path.pop(0)


def test_bench_rows_and_projection(tmp_path):
    report, stdout = _bench(tmp_path, "--rows", "propose8b,verify,decode")
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"propose8b", "verify", "decode"}
    for r in rows.values():
        assert r["ms"] > 0 and r["floor_ms"] > 0
        assert r["ratio"] == pytest.approx(r["ms"] / r["floor_ms"])
    proj = report["projection"]
    assert proj["step_ms"] == pytest.approx(rows["propose8b"]["ms"] + rows["verify"]["ms"])
    for p in proj["rows"]:  # speculative tok/s = tau / step, autoregressive = 1 / decode
        assert p["spec_tokens_per_s"] == pytest.approx(p["tau"] * 1e3 / proj["step_ms"])
        assert p["speedup"] == pytest.approx(p["spec_tokens_per_s"] / p["ar_tokens_per_s"])
    assert "Projected end to end" in stdout


def test_bench_without_the_projection_rows(tmp_path):
    report, _ = _bench(tmp_path, "--rows", "decode")
    assert report["projection"] is None


def test_bench_variants(tmp_path):
    report, stdout = _bench(tmp_path, "--variants", "default;DFLASH_HOST_TILED=1", "--rounds", "2", "--rows", "decode")
    assert report["variants"] == ["default", "DFLASH_HOST_TILED=1"]
    (row,) = report["rows"]
    for label in report["variants"]:
        runs = row["variants"][label]["runs_ms"]
        assert len(runs) == 2 and all(ms > 0 for ms in runs)
    assert "| decode 8B target, 1 row, ctx 1024 |" in stdout


def test_bench_variants_expand_the_environment(tmp_path):
    """A variant's values expand $NAME (gpu_check.sh --ab: DFLASH_LIBRARY=$AB_LIBRARY loads another build's
    library): a missing library fails that variant by name."""
    env = {**os.environ, "AB_TEST_LIBRARY": str(tmp_path / "no_such_libdflash.so")}
    proc = subprocess.run([sys.executable, BENCH, "--tiny", "--iters", "2", "--rounds", "1", "--rows", "decode",
                           "--variants", "DFLASH_LIBRARY=$AB_TEST_LIBRARY"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "no_such_libdflash.so" in proc.stdout + proc.stderr  # expanded: the path, not $AB_TEST_LIBRARY


def test_bench_variants_reject_a_bad_setting(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--tiny", "--variants", "default;NOT_A_SETTING"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "is not NAME=VALUE" in proc.stdout + proc.stderr


def test_bench_variant_values_may_hold_commas():
    """A variant's settings split at a comma only where NAME= follows, so a list value stays whole."""
    bench = _bench_module()
    assert bench.parse_variant("DFLASH_X=1,8") == ("DFLASH_X=1,8", {"DFLASH_X": "1,8"})
    assert bench.parse_variant("DFLASH_X=1,8, DFLASH_Y=2,DFLASH_Z=a")[1] == {"DFLASH_X": "1,8", "DFLASH_Y": "2",
                                                                           "DFLASH_Z": "a"}
    assert bench.parse_variant(" default ") == ("default", {})
    for bad in ("=2", "NOT_A_SETTING"):
        with pytest.raises(SystemExit, match="is not NAME=VALUE"):
            bench.parse_variant(bad)


def test_bench_prefill_and_long_context_rows(tmp_path):
    """The prefill row has no goal (compute-bound: JSON null, "-" in the table); the 8k rows count the K/V cache in
    their floor (above the short rows' floor) and aim at 1.15x it."""
    report, stdout = _bench(tmp_path, "--rows", "prefill,verify,verify_8k")
    rows = {r["row"]: r for r in report["rows"]}
    assert rows["prefill"]["goal_ms"] is None
    pre = rows["prefill"]  # compute-bound: its floor is the larger of the FLOPs at peak and the weights read once
    assert pre["compute_floor_ms"] > 0 and pre["bandwidth_floor_ms"] > 0
    assert pre["floor_ms"] == pytest.approx(max(pre["compute_floor_ms"], pre["bandwidth_floor_ms"]))
    assert "| prefill 8B target, 1024 tokens |" in stdout
    assert rows["verify_8k"]["bytes"] > rows["verify"]["bytes"]
    assert rows["verify_8k"]["goal_ms"] == pytest.approx(1.15 * rows["verify_8k"]["floor_ms"])


def test_prefill_flops_counts_gemms_attention_and_one_lm_head_row():
    bench = _bench_module()
    base = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                vocab_size=10)
    # per row and layer: q/k/v 8 x (2 + 2) x 4 = 128, o 2 x 4 x 8 = 64, MLP 3 x 8 x 16 = 384 multiply-adds;
    # attention: rows 1 + 2 + 3 keys x 2 heads x 4 dims x 2 (q.k and p.v) = 96; lm_head 10 x 8 = 80
    assert bench.prefill_flops(base, 2, 3) == 2 * (2 * ((128 + 64 + 384) * 3 + 96) + 80)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
def test_cubin_diff_tells_changed_kernels_from_unchanged(tmp_path):
    """tools/cubin_diff.py's ELF reading and comparison on two real cubins: one kernel edited, one kept, one added."""
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import cubin_diff
    finally:
        sys.path.pop(0)
    src = tmp_path / "k.cu"

    def cubin(body):
        src.write_text(body)
        out = tmp_path / "k.cubin"
        subprocess.run(["nvcc", "-arch=sm_90", "-cubin", str(src), "-o", str(out)], check=True, timeout=300)
        return cubin_diff.text_sections(out.read_bytes())

    kept = "__global__ void kept(float *x) { x[threadIdx.x] *= 2.f; }\n"
    old = cubin(kept + "__global__ void edited(float *x) { x[threadIdx.x] += 1.f; }\n")
    new = cubin(kept + "__global__ void edited(float *x) { x[threadIdx.x] += 3.f; }\n"
                "__global__ void added(float *x) { x[0] = 0.f; }\n")
    assert all(name.startswith(".text.") for name in old) and len(old) == 2
    got = {name: status for status, name in cubin_diff.compare(old, new)}
    assert got == {".text._Z4keptPf": "same", ".text._Z6editedPf": "differs", ".text._Z5addedPf": "added"}
    assert dict((n, s) for s, n in cubin_diff.compare(new, old))[".text._Z5addedPf"] == "removed"
    with pytest.raises(ValueError):
        cubin_diff.text_sections(b"not an elf file at all" * 4)


def test_source_hash_follows_the_build_sources_only(tmp_path):
    """tools/source_hash.sh (what tools/prebuild.sh stamps and gpu_check.sh compares on the device, whose tree is a
    copy without .git): the same hash for a copy of the sources, unchanged by Python caches and by files the build
    does not read, changed by an edit of a kernel."""
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    script = os.path.join(root, "tools", "source_hash.sh")

    def source_hash(tree):
        proc = subprocess.run(["bash", os.path.join(tree, "tools", "source_hash.sh")], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout.strip()) == 64
        return proc.stdout.strip()

    copy = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "lib")
    for d in ("native", "pydflash", os.path.join("tests", "cuda")):
        shutil.copytree(os.path.join(root, d), copy / d, ignore=ignore)
    (copy / "tools").mkdir()
    for f in ("CMakeLists.txt", "pyproject.toml", os.path.join("tools", "gemm_chain_bench.cpp")):
        shutil.copy(os.path.join(root, f), copy / f)
    shutil.copy(script, copy / "tools" / "source_hash.sh")
    first = source_hash(str(copy))
    assert first == source_hash(root)
    (copy / "pydflash" / "__pycache__").mkdir()
    (copy / "pydflash" / "__pycache__" / "cli.cpython-312.pyc").write_bytes(b"\0cache")
    (copy / "tools" / "bench.py").write_text("# not built\n")
    assert source_hash(str(copy)) == first
    kernel = copy / "native" / "src" / "cuda" / "rope.cu"
    kernel.write_text(kernel.read_text() + "\n// an edit\n")
    assert source_hash(str(copy)) != first
