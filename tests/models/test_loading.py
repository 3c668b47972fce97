"""Presets and load_policy: seeded builds, cache folders, save/load round trip, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from ragen_tasks.models import PRESETS, build_preset, load_policy, save_policy
from ragen_tasks.models.tokenizer import lake_row_tokens


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("presets")


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tiny_preset_loads_and_is_cached(cache_dir) -> None:
    model, tok = load_policy("tiny", cache_dir=cache_dir)
    assert 100_000 <= _n_params(model) <= 300_000
    assert model.config.model_type == "qwen2" and not model.training
    folders = [p for p in cache_dir.iterdir() if p.name.startswith("tiny-")]
    assert len(folders) == 1 and (folders[0] / "model.safetensors").exists()
    model2, _ = load_policy("tiny", cache_dir=cache_dir)  # from the cache folder
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_small_preset_is_about_3m_params() -> None:
    model, _ = build_preset("small")
    assert 2_500_000 <= _n_params(model) <= 3_500_000


def test_build_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = build_preset("tiny")
    after = torch.rand(1)
    b, _ = build_preset("tiny")
    assert torch.equal(before, after)
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)


def test_composed_lake_rows_are_their_cells_sum_and_leave_other_tokens_alone() -> None:
    """``tiny-rows-composed``: a row token's embedding is a sum over its (column, symbol) cells, so two
    rows that swap a cell between them sum to the same vector; every other token keeps ``tiny-rows``'s
    embedding, and the row embeddings keep the scale of the rest."""
    from dataclasses import replace

    composed, tok = build_preset("tiny-rows-composed")
    plain, _ = build_preset("tiny-rows")
    emb = composed.get_input_embeddings().weight.detach()

    def row(text: str) -> torch.Tensor:
        (token_id,) = tok.encode(text)
        return emb[token_id]

    torch.testing.assert_close(row("O___") + row("_P_G"), row("OP_G") + row("____"))
    torch.testing.assert_close(row("_O_O") + row("G___"), row("GO__") + row("___O"))
    assert not torch.allclose(row("O___"), row("_O__"))  # a hole's column is part of the row's embedding
    rows = torch.tensor(tok.convert_tokens_to_ids(lake_row_tokens()))
    others = torch.ones(emb.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(emb[others], plain.get_input_embeddings().weight.detach()[others])
    assert 0.5 < emb[rows].std().item() / emb[others].std().item() < 2.0
    with pytest.raises(ValueError, match="composed_lake_rows=True needs lake_rows=True"):
        replace(PRESETS["tiny"], composed_lake_rows=True)


def test_save_and_load_from_folder_round_trips(cache_dir, tmp_path) -> None:
    model, tok = load_policy("tiny", cache_dir=cache_dir)
    save_policy(model, tok, tmp_path / "ckpt")
    model2, tok2 = load_policy(str(tmp_path / "ckpt"))
    ids = torch.tensor([tok.encode("<answer>Up || Left</answer> 0.15")])
    assert tok2.encode("<answer>Up || Left</answer> 0.15") == ids[0].tolist()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, model2(input_ids=ids).logits)


def test_bfloat16_loads_and_runs_on_cpu(cache_dir) -> None:
    model, tok = load_policy("tiny", dtype="bfloat16", cache_dir=cache_dir)
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("hello")])).logits
    assert torch.isfinite(logits.float()).all()


def test_missing_local_path_names_the_path(tmp_path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_policy(str(missing))


def test_unreachable_hub_id_says_offline(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        load_policy("ragen-test-org/definitely-not-cached-model")


def test_tokenizer_without_chat_template_is_rejected(cache_dir, tmp_path) -> None:
    model, tok = load_policy("tiny", cache_dir=cache_dir)
    folder = save_policy(model, tok, tmp_path / "nochat")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chat template"):
        load_policy(str(folder))


def test_bad_dtype_and_unknown_preset_folder() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_policy("tiny", dtype="int8")
    assert set(PRESETS) >= {"tiny", "small"}
