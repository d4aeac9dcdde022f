"""`kvserve eval perplexity` as a user runs it: a real process on the default model (the
default "gguf" quantization and float16 KV cache, as `kvserve serve`), GPL-3 at ctx 512,
held to llama.cpp's perplexity of the same file and weights (18.354, see
tests/model/test_perplexity.py for where the number comes from)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
GPL3 = ROOT.parent / "shared" / "reference" / "GPL-3.txt"
LLAMA_CPP_PPL, TOL = 18.354, 0.05

_PROGRESS = re.compile(r"\[(\d+)\](\d+\.\d{4}),")
_FINAL = re.compile(r"^PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})$")


def _eval(*flags: str) -> tuple[list[tuple[int, float]], float, float, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "kvserve.cli", "eval", "perplexity", "--text", str(GPL3),
           *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    progress_line, final_line = p.stdout.splitlines()  # stdout holds these two lines only
    progress = [(int(i), float(v)) for i, v in _PROGRESS.findall(progress_line)]
    assert _PROGRESS.sub("", progress_line) == ""  # nothing but [i]value, entries
    m = _FINAL.match(final_line)
    assert m, final_line
    return progress, float(m[1]), float(m[2]), p


@pytest.fixture(scope="module")
def full_run() -> tuple[list[tuple[int, float]], float, float, subprocess.CompletedProcess]:
    return _eval("--ctx", "512")


def test_cli_gpl3_ppl_matches_llama_cpp(full_run: Any) -> None:
    progress, ppl, stderr, p = full_run
    # 7,638 tokens (the trailing newline dropped, as llama.cpp's -f): 14 chunks of 512.
    assert [i for i, _ in progress] == list(range(1, 15))
    assert progress[-1][1] == ppl
    assert abs(ppl - LLAMA_CPP_PPL) < TOL, ppl
    # stderr = PPL * sd(NLL) / sqrt(3570 tokens): a per-token NLL spread of 1..6 nats puts it
    # in this range; 0 or a PPL-sized value would be a wrong formula.
    assert ppl * 1 / 3570 ** 0.5 < stderr < ppl * 6 / 3570 ** 0.5, stderr
    assert "14 chunks x 255 scored tokens of 7638" in p.stderr
    assert "quantization gguf, KV cache float16" in p.stderr


def test_cli_chunks_and_batch(full_run: Any) -> None:
    # The first 2 chunks, one chunk per step instead of 4: the same numbers as the full run's
    # first two (the engine's output does not depend on the batch, and --chunks only cuts).
    progress, ppl, _stderr, _p = _eval("--ctx", "512", "--chunks", "2", "--batch", "512")
    assert progress == full_run[0][:2]
    assert ppl == full_run[0][1][1]


@pytest.mark.parametrize("flags,message", [
    (["--ctx", "511"], "--ctx must be an even number >= 4"),
    (["--ctx", "2"], "--ctx must be an even number >= 4"),
    (["--ctx", "0"], "--ctx must be an even number >= 4"),
    (["--ctx", "-512"], "--ctx must be an even number >= 4"),
    (["--chunks", "0"], "--chunks must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--max-model-len", "512"], "--max-model-len must be > --ctx (512)"),
])
def test_cli_bad_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", "perplexity", "--text", str(GPL3), *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err, err


def test_cli_missing_file(tmp_path: Path) -> None:
    # A real process: the message, exit 2, and no traceback.
    missing = tmp_path / "nope.txt"
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "eval", "perplexity", "--text",
                        str(missing)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       check=False)
    assert p.returncode == 2
    assert f"error: --text {str(missing)!r}: no such file" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_cli_text_too_short_and_ctx_too_long(tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    short = tmp_path / "short.txt"
    short.write_text("a few words, far fewer than two chunks\n")
    assert main(["eval", "perplexity", "--text", str(short), "--ctx", "512"]) == 2
    assert "perplexity at ctx 512 needs at least 2 x ctx = 1024" in capsys.readouterr().err
    # SmolLM2's context is 8192 positions; a chunk of 8192 needs one more.
    assert main(["eval", "perplexity", "--text", str(GPL3), "--ctx", "8192"]) == 2
    err = capsys.readouterr().err
    assert "max_model_len (8193) must be <= the model's context length (8192)" in err, err
    assert "(here max_model_len is --ctx + 1 = 8193)" in err
