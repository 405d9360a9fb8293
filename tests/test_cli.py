"""The `pydflash` command: generate and bench on the embedded default pair and on test checkpoints, one-line
errors with exit 2, the tokenizers, and the default model's cache. Everything but the tokenizer and cache tests
needs the library (set DFLASH_LIBRARY) and skips without it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import make_checkpoint
from pydflash import _ffi
from pydflash.default_model import VERSION, ensure_default_model
from pydflash.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def library():
    try:
        return _ffi.load()
    except ImportError as e:
        pytest.skip(f"libdflash not loadable: {e}")


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg_cache")


@pytest.fixture
def cli(library, cache_home, monkeypatch, capsys):
    """cli(*argv) -> (exit code, stdout, stderr), with the default model cached under a test directory."""
    from pydflash.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))

    def run(*argv):
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A byte-sized Qwen3 target (no tokenizer.json) and its drafter."""
    root = tmp_path_factory.mktemp("cli_pair")
    target = make_checkpoint.make_target(str(root / "target"), vocab_size=260, eos_token_id=256, seed=41,
                                         max_position_embeddings=512)
    draft = make_checkpoint.make_drafter(str(root / "draft"), target_dir=target, block_size=4, seed=42)
    return Path(target), Path(draft)


# --------------------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------------------

def _default_block_size():
    from pydflash import default_model

    return json.loads((default_model.ensure_default_model()[1] / "config.json").read_text())["block_size"]


def test_generate_text_on_the_default_model(cli, cache_home):
    code, out, err = cli("generate", "def fibonacci(n):", "--max-new-tokens", 16, "--backend", "host")
    assert code == 0, err
    assert out.endswith("\n")
    summary = err.strip().splitlines()[-1]
    block = _default_block_size()
    for words in ("tokens in", "tok/s", "steps", "mean acceptance", f"block {block}", "host"):
        assert words in summary, summary
    assert (cache_home / "pydflash" / VERSION / "target" / "model.safetensors").is_file()


def test_generate_json_spec_equals_autoregressive(cli):
    code, out, err = cli("generate", "def fibonacci(n):", "--max-new-tokens", 24, "--json", "--ignore-eos")
    assert code == 0, err
    spec = json.loads(out)
    for key in ("output_ids", "acceptance_lengths", "drafts", "tokens_per_second", "mean_acceptance_length",
                "text", "prompt_ids", "time_to_first_token", "backend"):
        assert key in spec, key
    assert len(spec["output_ids"]) == 24 and spec["prompt_ids"] == list(b"def fibonacci(n):")
    assert sum(spec["acceptance_lengths"]) == 23 and len(spec["drafts"]) == len(spec["acceptance_lengths"])
    code, out, _ = cli("generate", "def fibonacci(n):", "--max-new-tokens", 24, "--json", "--ignore-eos",
                       "--block-size", 1)
    ar = json.loads(out)
    assert code == 0 and ar["output_ids"] == spec["output_ids"] and ar["text"] == spec["text"]
    assert ar["block_size"] == 1 and ar["drafts"] == [[]] * 23


def test_generate_stops_at_eos_unless_told_not_to(cli, small_pair):
    target, draft = small_pair
    base = ["generate", "--target", target, "--draft", draft, "--prompt-ids", "1,2,3", "--json"]
    code, out, _ = cli(*base, "--max-new-tokens", 40, "--ignore-eos")
    full = json.loads(out)["output_ids"]
    code, out, _ = cli(*base, "--max-new-tokens", 40)
    with_eos = json.loads(out)["output_ids"]
    assert code == 0
    if 256 in full:
        assert with_eos == full[:full.index(256) + 1]
    else:
        assert with_eos == full


def test_generate_prompt_ids_and_sampling(cli, small_pair):
    target, draft = small_pair
    code, out, err = cli("generate", "--target", target, "--draft", draft, "--prompt-ids", "72, 105", "--json",
                         "--temperature", 0.9, "--top-k", 20, "--seed", 5, "--max-new-tokens", 12)
    assert code == 0, err
    first = json.loads(out)
    assert first["seed"] == 5 and len(first["output_ids"]) <= 12 and "text" in first  # bytes: a ByteTokenizer
    code, out, _ = cli("generate", "--target", target, "--draft", draft, "--prompt-ids", "72,105", "--json",
                       "--temperature", 0.9, "--top-k", 20, "--seed", 5, "--max-new-tokens", 12)
    assert json.loads(out)["output_ids"] == first["output_ids"]  # reproducible from the seed
    code, out, err = cli("generate", "--target", target, "--prompt-ids", "1,2", "--block-size", 1,
                         "--max-new-tokens", 5)
    assert code == 0 and out.strip() and "block 1" in err  # a target alone decodes autoregressively


def _one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pydflash: error: "), err
    return lines[0]


def _error_cases(small_pair, tmp_path):
    target, draft = small_pair
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    tiny = tmp_path / "tiny"
    make_checkpoint.make_target(str(tiny), vocab_size=100)
    prompts = tmp_path / "empty.txt"
    prompts.write_text("\n\n")
    return [
        (["generate", "--prompt-ids", "1,2,300"], "300 at index 2"),
        (["generate", "--prompt-ids", "1,x"], "comma-separated"),
        (["generate"], "PROMPT"),
        (["generate", "hi", "--prompt-ids", "1"], "exactly one"),
        (["generate", "hi", "--target", tmp_path / "nope", "--draft", draft], "no such directory"),
        (["generate", "hi", "--target", target, "--draft", tmp_path / "nope"], "no such directory"),
        (["generate", "hi", "--draft", draft], "--draft needs --target"),
        (["generate", "hi", "--target", target], "--target needs --draft"),
        (["generate", "hi", "--max-new-tokens", 5000], "max_position_embeddings 4096"),
        (["generate", "x" * 5000], "longer than the target's max_position_embeddings"),
        (["generate", "hi", "--max-new-tokens", -1], "--max-new-tokens"),
        (["generate", "hi", "--top-p", 0], "top_p"),
        (["generate", "hi", "--temperature", -1], "non-negative"),
        (["generate", "hi", "--block-size", _default_block_size() + 1], f"block_size {_default_block_size()}"),
        (["generate", "hi", "--block-size", 0], "--block-size"),
        (["generate", "--target", broken, "--draft", draft, "--prompt-ids", "1"], "safetensors"),
        (["generate", "hi", "--target", tiny, "--block-size", 1], "pass token ids"),
        (["generate", "--target", target, "--draft", tiny, "--prompt-ids", "1"], ""),
        (["bench", "--block-size", 1], "--block-size must be >= 2"),
        (["bench", "--prompts", tmp_path / "nope.txt"], "no such file"),
        (["bench", "--prompts", prompts], "holds no prompt"),
    ]


def test_user_errors_are_one_line_exit_2(cli, small_pair, tmp_path):
    for argv, words in _error_cases(small_pair, tmp_path):
        code, out, err = cli(*argv)
        assert code == 2, (argv, err)
        assert words in _one_error_line(err), (argv, err)
        assert out == ""


def test_no_traceback_from_the_console_entry(library, cache_home, small_pair):
    target, draft = small_pair
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pydflash", "generate", "--target", str(target), "--draft",
                           str(draft), "--prompt-ids", "1,2,999"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "999 at index 2" in _one_error_line(proc.stderr)


def test_backend_auto(cli, library):
    code, out, err = cli("generate", "--prompt-ids", "1,2", "--max-new-tokens", 4, "--json")
    assert code == 0, err
    backend = json.loads(out)["backend"]
    cuda_built = library.lib.dflash_backend_compiled(library.lib.DFLASH_BACKEND_CUDA)
    count = library.ffi.new("int32_t *")
    has_device = cuda_built and library.lib.dflash_cuda_device_count(count) == 0 and count[0] > 0
    if not has_device:
        assert backend == "host" and err == ""  # no device: host, silently
    elif backend == "host":
        assert "cannot run here" in err  # a device, but the cuda backend could not run: a note, then host


def test_backend_fallback_note(cli, library, monkeypatch):
    """When cuda is tried first (auto on a GPU machine) and the library says it cannot run, host takes over with
    a note. Forced here: without a device (or a cuda build) the library refuses cuda the same way."""
    from pydflash import cli as cli_module

    count = library.ffi.new("int32_t *")
    if library.lib.dflash_backend_compiled(library.lib.DFLASH_BACKEND_CUDA) and \
            library.lib.dflash_cuda_device_count(count) == 0 and count[0] > 0:
        pytest.skip("a CUDA device is present: cuda may well run")
    monkeypatch.setattr(cli_module, "_backend_order", lambda choice: ["cuda", "host"] if choice == "auto" else [choice])
    code, out, err = cli("generate", "--prompt-ids", "1,2", "--max-new-tokens", 4, "--json")
    assert code == 0 and json.loads(out)["backend"] == "host"
    assert "note: the cuda backend cannot run here" in err and "using host" in err
    code, out, err = cli("generate", "--prompt-ids", "1,2", "--max-new-tokens", 4, "--backend", "cuda")
    assert code == 2 and "DFLASH_STATUS_" in _one_error_line(err)  # asked for explicitly: no fallback


# --------------------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------------------

def test_bench_json(cli, small_pair, tmp_path):
    target, draft = small_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n\nsome more text\n")
    code, out, err = cli("bench", "--target", target, "--draft", draft, "--prompts", prompts,
                         "--max-new-tokens", 12, "--json", "--ignore-eos")
    assert code == 0, err
    report = json.loads(out)
    assert report["num_prompts"] == 2 and report["same_output"] == 2  # greedy: lossless
    assert [p["prompt"] for p in report["prompts"]] == ["hello there", "some more text"]
    assert len(report["acceptance_rate_by_position"]) == 3
    assert all(0 <= r <= 1 for r in report["acceptance_rate_by_position"])
    assert report["acceptance_rate_by_position"] == sorted(report["acceptance_rate_by_position"], reverse=True)
    lengths = [a for p in report["prompts"] for a in p["spec"]["acceptance_lengths"]]
    assert report["mean_acceptance_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert report["speedup"] == pytest.approx(report["spec_tokens_per_second"] / report["ar_tokens_per_second"])
    assert "2/2" in err  # the progress bar


def test_bench_table_on_the_default_model(cli):
    code, out, err = cli("bench", "--max-new-tokens", 8, "--backend", "host")
    assert code == 0, err
    assert "speedup" in out and "acceptance rate by draft position" in out
    assert out.count("\n") >= 8 + 5  # a row per built-in prompt, headers, totals


def test_bench_plot(cli, small_pair, tmp_path):
    target, draft = small_pair
    argv = ["bench", "--target", target, "--draft", draft, "--max-new-tokens", 4, "--plot", tmp_path / "b.png"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, _, err = cli(*argv)
        assert code == 2 and "--plot needs matplotlib" in _one_error_line(err)
        return
    code, _, err = cli(*argv)
    assert code == 0, err
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------------------------
# tokenizers, default model
# --------------------------------------------------------------------------------------------------------------

def test_byte_tokenizer():
    tok = ByteTokenizer(258, {256: "<|eos|>"})
    text = "héllo, wörld ✓"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 105, 256, 257]) == "hi"
    assert tok.decode([104, 256, 105, 257], skip_special_tokens=False) == "h<|eos|>i<|257|>"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character decodes, replaced
    with pytest.raises(TokenizerError):
        ByteTokenizer(255)


def test_load_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [256, 3]}))
    tok = load_tokenizer(tmp_path, 300)
    assert isinstance(tok, ByteTokenizer) and tok.special_tokens == {256: "<|eos|>"}
    with pytest.raises(TokenizerError, match="pass token ids"):
        load_tokenizer(tmp_path, 100)
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, 100)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world nope") == [1, 2, 0]
    assert tok.decode([1, 2, 3]) == "hello world"
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="unreadable"):
        load_tokenizer(tmp_path, 100)


def test_default_model_is_deterministic_and_atomic(tmp_path):
    a_target, a_draft = ensure_default_model(tmp_path / "a")
    b_target, b_draft = ensure_default_model(tmp_path / "b")
    for x, y in ((a_target, b_target), (a_draft, b_draft)):
        for name in ("config.json", "model.safetensors"):
            assert (x / name).read_bytes() == (y / name).read_bytes()
    # Concurrent first runs into one root: every process gets a complete pair, no temporary directory is left.
    root = tmp_path / "shared"
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from pydflash.default_model import " \
           f"ensure_default_model; print(ensure_default_model({str(root)!r})[0])"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate()[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and set(outputs) == {str(root / "target")}
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "shared"]
    assert (root / "target" / "model.safetensors").read_bytes() == (a_target / "model.safetensors").read_bytes()
