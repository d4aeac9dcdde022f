"""Medusa heads (kvserve/spec/medusa.py): the checkpoint format round-trips, a file written
in Medusa's own module layout loads and computes what Medusa's modules compute, a head
equal to the target's lm_head is recognised as shared, bad files are refused by name, the
training targets shift as Medusa's loss does, and the proposer drafts the heads' top-1 only
from a hidden state that is still the request's last token's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kvserve.spec.medusa import MedusaHeads, MedusaProposer
from kvserve.spec.medusa_train import head_targets

H, V = 16, 40


def _random_heads(k: int = 3, layers: int = 2, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(k, layers, H, V)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    heads.lm_heads = [torch.randn(V, H) for _ in range(k)]
    return heads


def _logits(heads: MedusaHeads, x: torch.Tensor, lm_head: torch.Tensor | None = None
            ) -> torch.Tensor:
    return torch.stack([heads.hidden(i, x) @ (heads.lm_heads[i] if heads.lm_heads[i]
                                              is not None else lm_head).T
                        for i in range(heads.num_heads)])


def test_save_then_load_is_equal(tmp_path: Path) -> None:
    heads = _random_heads()
    heads.save(str(tmp_path), dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 2)
    assert "base_model_name_or_path" in cfg
    back = MedusaHeads.load(str(tmp_path))
    assert (back.num_heads, back.num_layers, back.hidden_size, back.vocab_size) == (3, 2, H, V)
    a, b = heads.medusa_state_dict(), back.medusa_state_dict()
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # float16 (the default): equal to its rounding.
    heads.save(str(tmp_path / "f16"))
    half = MedusaHeads.load(str(tmp_path / "f16")).medusa_state_dict()
    for key in a:
        assert torch.equal(half[key], a[key].half().float()), key


class _MedusaResBlock(nn.Module):
    """Medusa's ResBlock, as its medusa_model.py defines it: x + SiLU(linear(x))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def _medusa_module(k: int, layers: int) -> nn.ModuleList:
    """Medusa's medusa_head: ModuleList of Sequential(ResBlock * layers, Linear no bias)."""
    torch.manual_seed(1)
    m = nn.ModuleList(nn.Sequential(*[_MedusaResBlock(H) for _ in range(layers)],
                                    nn.Linear(H, V, bias=False)) for _ in range(k))
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    return m


@pytest.mark.parametrize("file", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_a_file_in_medusas_layout_loads_and_computes_the_same(tmp_path: Path,
                                                              file: str) -> None:
    ref = _medusa_module(4, 1)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    assert "0.0.linear.weight" in state and "0.0.linear.bias" in state and "0.1.weight" in state
    if file.endswith(".pt"):
        torch.save(state, tmp_path / file)
    else:
        save_file(state, str(tmp_path / file))
    # A config as MedusaConfig.save_pretrained writes it (PretrainedConfig's keys beside).
    (tmp_path / "config.json").write_text(json.dumps({
        "medusa_num_heads": 4, "medusa_num_layers": 1,
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "transformers_version": "4.34.0",
        "version": "2"}))
    heads = MedusaHeads.load(str(tmp_path))
    assert heads.base_model == "lmsys/vicuna-7b-v1.3"
    x = torch.randn(5, H)
    with torch.no_grad():
        want = torch.stack([ref[i](x) for i in range(4)])
        assert torch.allclose(_logits(heads, x), want, atol=1e-5)


def test_a_head_equal_to_the_targets_lm_head_runs_on_it(tmp_path: Path) -> None:
    heads = _random_heads(k=3, layers=1)
    w = torch.randn(V, H)
    heads.lm_heads = [None, heads.lm_heads[1], None]  # heads 0 and 2: the target's
    heads.save(str(tmp_path), lm_head=w)  # float16: equal to its rounding
    back = MedusaHeads.load(str(tmp_path), target_lm_head=w)
    assert back.lm_heads[0] is None and back.lm_heads[2] is None
    assert back.lm_heads[1] is not None
    assert torch.allclose(back.lm_heads[1], heads.lm_heads[1], atol=1e-2)
    # Without the target's weight (or with another one) every head keeps its own.
    other = MedusaHeads.load(str(tmp_path), target_lm_head=w + 0.1)
    assert all(x is not None for x in other.lm_heads)


def test_bad_files_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        MedusaHeads.load(str(tmp_path))
    heads = _random_heads(k=2, layers=1)
    heads.save(str(tmp_path), dtype=torch.float32)
    (tmp_path / "medusa_lm_head.safetensors").rename(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="neither medusa_lm_head.safetensors nor"):
        MedusaHeads.load(str(tmp_path))
    state = heads.medusa_state_dict()
    del state["1.0.linear.bias"]
    save_file({k: v.contiguous() for k, v in state.items()},
              str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="missing tensor '1.0.linear.bias'"):
        MedusaHeads.load(str(tmp_path))
    state = heads.medusa_state_dict()
    state["1.0.linear.weight"] = torch.zeros(H, H + 1)
    save_file({k: v.contiguous() for k, v in state.items()},
              str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"'1.0.linear.weight' has shape \(16, 17\)"):
        MedusaHeads.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(ValueError, match="integer medusa_num_heads and medusa_num_layers"):
        MedusaHeads.load(str(tmp_path))


def test_untrained_heads_are_the_lm_head() -> None:
    heads = MedusaHeads(2, 1, H, V)
    x = torch.randn(3, H)
    assert torch.equal(heads.hidden(0, x), x) and torch.equal(heads.hidden(1, x), x)


def test_head_k_targets_the_token_k_plus_one_ahead() -> None:
    # greedy[p] is the target's token for position p + 1; head k at row p learns the one
    # for position p + 1 + k (Medusa's labels[..., 2 + i:] against logits[i, :, :-(2 + i)]).
    greedy = torch.tensor([10, 11, 12, 13, 14])
    rows, targets = head_targets(greedy, 3)
    assert rows.tolist() == [0, 1, 2, 3]
    assert targets.tolist() == [[11, 12, 13], [12, 13, 14], [13, 14, -100], [14, -100, -100]]
    rows, targets = head_targets(greedy, 2, start=2)
    assert rows.tolist() == [2, 3] and targets.tolist() == [[13, 14], [14, -100]]


class _Target:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.calls = 0

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x @ self.w.T


class _Req:
    def __init__(self, rid: str, n: int) -> None:
        self.request_id = rid
        self.all_token_ids = list(range(n))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def test_the_proposer_drafts_each_heads_top1_from_the_last_tokens_hidden_state() -> None:
    heads = _random_heads(k=3, layers=1)
    w = torch.randn(V, H)
    heads.lm_heads[0] = None  # head 0 on the target's lm_head, 1 and 2 on their own
    target = _Target(w)
    prop = MedusaProposer(heads, target)
    a, b, c = _Req("a", 5), _Req("b", 7), _Req("c", 3)
    h = torch.randn(3, H)
    prop.observe_hidden([a, b, c], h, [[1], [2, 3], [4]])
    for r, n in ((a, 1), (b, 2)):  # the scheduler appends the emitted tokens
        r.all_token_ids += [0] * n
    c.all_token_ids += [4, 5]  # c's tokens changed since: its hidden state is stale
    drafts = prop.propose([a, b, c], [3, 2, 3], [[], [], []])
    want = _logits(heads, h[:2], w).argmax(-1)  # [K, 2]
    assert drafts[0] == want[:, 0].tolist()
    assert drafts[1] == want[:2, 1].tolist()
    assert drafts[2] == []
    assert target.calls == 1
    assert prop.draft_probs([a, b, c], drafts) is None
    prop.remove(["a"])
    assert prop.propose([a], [2], [[]]) == [[]]
