"""`kvserve train-medusa` end to end on a tiny random Llama saved as an HF directory: it
writes a Medusa directory (config.json, medusa_lm_head.safetensors in Medusa's names) that
loads, whose heads run as the engine's medusa proposer with greedy output unchanged, and a
bad output directory is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.spec.medusa import MedusaHeads
from tests.conftest import run_all
from tests.e2e.test_quantize_cli import CALIB, tiny_dir  # noqa: F401  (a fixture)


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "train-medusa", *args],
                          capture_output=True, text=True, timeout=300)


def test_train_medusa_writes_heads_that_load_and_run(tiny_dir: Any,  # noqa: F811
                                                     tmp_path: Path) -> None:
    model_dir, _ = tiny_dir
    text = tmp_path / "text.txt"
    text.write_text(CALIB.read_text()[:3000])
    out = tmp_path / "heads"
    r = _train(str(model_dir), "--text", str(text), "-o", str(out), "--num-heads", "2",
               "--steps", "3", "--max-tokens", "1500", "--gen-prompts", "2",
               "--gen-tokens", "16", "--kv-cache-memory", "16MiB")
    assert r.returncode == 0, r.stderr
    assert "head 1:" in r.stdout and "head 2:" in r.stdout, r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (2, 1)
    assert cfg["base_model_name_or_path"] == str(model_dir)
    with safe_open(str(out / "medusa_lm_head.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.weight",
                                    "1.0.linear.bias", "1.0.linear.weight", "1.1.weight"]
        assert tuple(f.get_tensor("1.1.weight").shape) == (256, 64)
    heads = MedusaHeads.load(str(out))
    assert (heads.num_heads, heads.hidden_size, heads.vocab_size) == (2, 64, 256)

    prompts = [list(range(40, 80)), list(range(100, 130))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "medusa", "model": str(out), "num_speculative_tokens": 2,
                        "adaptive": False}):
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(model_dir), kv_cache_memory="16MiB", speculative_config=spec))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        outs.append({k: v.outputs[0].token_ids for k, v in run_all(engine).items()})
    assert outs[0] == outs[1]
    # Its heads share the target's lm_head (trained blocks only) and drafted every step.
    assert all(w is None for w in engine.runner.proposer.heads.lm_heads)
    assert engine.runner.spec_stats.num_draft_tokens > 0


def test_train_medusa_refuses_a_non_empty_output(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("")
    r = _train("--text", str(CALIB), "-o", str(tmp_path))
    assert r.returncode == 2
    assert "exists and is not an empty directory" in r.stderr
