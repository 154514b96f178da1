"""Real-weights path: HF folders and Meta's sam3.pt load to the same model, strictly, with clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.errors import WeightsError
from sam3_aoti.model.meta_keys import to_meta, to_transformers
from sam3_aoti.model.configs import example_inputs, tiny_config
from sam3_aoti.model.grounding import Sam3Grounding
from sam3_aoti.runtime.tokenizer import ClipTokenizer, checkpoint_merges, read_merges_text
from sam3_aoti.model.checkpoints import load_hf_folder, load_meta_checkpoint

from helpers import copy_repo, hf_tokenizer_files, run_doit

META_KEYS = Path(__file__).parent / "data" / "meta_sam3_detector_keys.txt"


def meta_tensors(path: Path) -> dict:
    """Shape-only tensors for every key of Meta's sam3 0.1.4 detector (dumped from the model it builds)."""
    tensors = {}
    for line in path.read_text().splitlines():
        key, shape, dtype = line.split()
        tensors[key] = torch.empty([int(s) for s in shape.split("x")], dtype=getattr(torch, dtype), device="meta")
    return tensors


def test_key_table_maps_metas_full_model_onto_transformers_exactly():
    from transformers import Sam3Config, Sam3Model

    with torch.device("meta"):
        expected = Sam3Model(Sam3Config()).state_dict()
    meta = meta_tensors(META_KEYS)
    converted, unknown = to_transformers(meta)
    assert unknown == []
    assert sorted(converted) == sorted(expected)
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in expected.items()}
    back = to_meta(expected)  # the inverse lands on Meta's names and shapes too
    assert {k: v.shape for k, v in back.items()} == {
        k: v.shape for k, v in meta.items() if "sam2_convs" not in k and "freqs_cis" not in k and "points_" not in k}


TRANSFORMERS_KEYS = Path(__file__).parent / "data" / "transformers_sam3_key_mapping.txt"


def differences_from_transformers() -> list[str]:
    """Meta keys that `to_transformers` names differently from transformers' own conversion script
    (tests/data/transformers_sam3_key_mapping.txt, written by scripts/fixtures/make_transformers_key_fixture.py)."""
    from transformers import Sam3Config, Sam3Model

    with torch.device("meta"):
        model_keys = Sam3Model(Sam3Config()).state_dict().keys()
    differ = []
    for line in TRANSFORMERS_KEYS.read_text().splitlines():
        if line.startswith("#"):
            continue
        meta, *theirs = line.split()
        ours, _ = to_transformers({"detector." + meta: torch.zeros(3, 6)})
        if ours and sorted(ours) != sorted(theirs):
            differ.append(f"{meta}: ours {sorted(ours)}, transformers {theirs}")
        if not ours and any(name in model_keys for name in theirs):  # we drop it: so must transformers
            differ.append(f"{meta}: dropped by us, transformers loads it as {theirs}")
    return differ


def test_key_table_agrees_with_transformers_conversion_script():
    assert differences_from_transformers() == []


def test_swapping_two_same_shaped_entries_of_the_key_table_is_caught(monkeypatch):
    """The audit's example: the decoder's norm1/norm2 swapped passes a round trip through our own table."""
    from sam3_aoti.model import meta_keys as meta_checkpoint

    swap = {"detr_decoder.layers.{n}.vision_cross_attn_layer_norm.": "detr_decoder.layers.{n}.self_attn_layer_norm.",
            "detr_decoder.layers.{n}.self_attn_layer_norm.": "detr_decoder.layers.{n}.vision_cross_attn_layer_norm."}
    monkeypatch.setattr(meta_checkpoint, "KEY_MAP", [(m, swap.get(hf, hf)) for m, hf in meta_checkpoint.KEY_MAP])
    meta_checkpoint._rules.cache_clear()
    try:
        differ = differences_from_transformers()
    finally:
        monkeypatch.undo()
        meta_checkpoint._rules.cache_clear()
    assert len(differ) == 2 * 6 * 2  # norm1 and norm2 (weight, bias) of each of the 6 decoder layers


def test_random_init_gives_every_tensor_distinct_values(tiny_model):
    """No constant tensor and no two equal tensors of one shape, so a swapped conversion entry changes outputs."""
    params = dict(tiny_model.named_parameters())
    constant = [name for name, p in params.items() if p.numel() > 1 and bool(p.min() == p.max())]
    assert constant == []
    by_shape: dict = {}
    for name, p in params.items():
        by_shape.setdefault(tuple(p.shape), []).append(name)
    equal = [(a, b) for names in by_shape.values() for i, a in enumerate(names) for b in names[i + 1:]
             if torch.equal(params[a], params[b])]
    assert equal == []


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model):
    """The tiny model written in both formats, as a user would have them."""
    root = tmp_path_factory.mktemp("ckpt")
    tiny_model.save_pretrained(root / "hf")
    meta = to_meta(tiny_model.state_dict())
    meta["tracker.sam_mask_decoder.conv_s0.weight"] = torch.zeros(2)  # video tracker: not Sam3Model's
    torch.save({"model": meta}, root / "sam3.pt")
    return root


def outputs(model):
    config = tiny_config()
    with torch.no_grad():
        return Sam3Grounding(model.eval())(*example_inputs(config, 2, 3))


def test_both_formats_load_to_identical_outputs(checkpoints, tiny_model):
    from_hf = load_hf_folder(checkpoints / "hf")
    from_meta = load_meta_checkpoint(checkpoints / "sam3.pt", tiny_config())
    reference = tiny_model.state_dict()
    for model in (from_hf, from_meta):
        state = model.state_dict()
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference)
    for a, b in zip(outputs(from_hf), outputs(from_meta)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # attention kernels may differ by construction path


def rewrite_meta(src: Path, dest: Path, edit) -> Path:
    state = torch.load(src, weights_only=True)["model"]
    edit(state)
    torch.save({"model": state}, dest)
    return dest


def test_meta_renamed_key_lists_both_names(checkpoints, tmp_path):
    key = "detector.transformer.decoder.layers.0.linear1.weight"
    path = rewrite_meta(checkpoints / "sam3.pt", tmp_path / "renamed.pt",
                        lambda s: s.__setitem__(key.replace("linear1", "linear_1"), s.pop(key)))
    with pytest.raises(WeightsError) as e:
        load_meta_checkpoint(path, tiny_config())
    message = str(e.value)
    assert "\n" not in message
    assert "detr_decoder.layers.0.mlp.fc1.weight" in message and "linear_1" in message


def test_meta_wrong_shape_names_the_tensor(checkpoints, tmp_path):
    key = "detector.dot_prod_scoring.hs_proj.weight"
    path = rewrite_meta(checkpoints / "sam3.pt", tmp_path / "shape.pt", lambda s: s.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(WeightsError, match=r"wrongly shaped \(dot_product_scoring.query_proj.weight \(3, 3\) vs model"):
        load_meta_checkpoint(path, tiny_config())


def test_meta_truncated_file_is_a_clear_error(checkpoints, tmp_path):
    raw = (checkpoints / "sam3.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(WeightsError, match="not a complete PyTorch checkpoint"):
        load_meta_checkpoint(tmp_path / "cut.pt", tiny_config())


def hf_copy(src: Path, dest: Path, edit=None, raw_edit=None) -> Path:
    dest.mkdir()
    (dest / "config.json").write_bytes((src / "config.json").read_bytes())
    if raw_edit:
        (dest / "model.safetensors").write_bytes(raw_edit((src / "model.safetensors").read_bytes()))
    else:
        state = load_file(src / "model.safetensors")
        edit(state)
        save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_hf_missing_key_is_an_error_not_a_random_init(checkpoints, tmp_path):
    key = "detr_decoder.layers.0.self_attn.q_proj.weight"
    folder = hf_copy(checkpoints / "hf", tmp_path / "missing", lambda s: s.pop(key))
    with pytest.raises(WeightsError, match=r"1 missing \(detr_decoder.layers.0.self_attn.q_proj.weight\)"):
        load_hf_folder(folder)


def test_hf_renamed_and_wrongly_shaped_keys_are_listed(checkpoints, tmp_path):
    def edit(state):
        state["mask_decoder.renamed.weight"] = state.pop("mask_decoder.instance_projection.weight")
        state["dot_product_scoring.query_proj.weight"] = torch.zeros(3, 3)

    with pytest.raises(WeightsError) as e:
        load_hf_folder(hf_copy(checkpoints / "hf", tmp_path / "bad", edit))
    message = str(e.value)
    assert "missing (mask_decoder.instance_projection.weight)" in message
    assert "unexpected (mask_decoder.renamed.weight)" in message
    assert "dot_product_scoring.query_proj.weight (3, 3) vs model" in message


def test_hf_truncated_file_is_a_clear_error(checkpoints, tmp_path):
    folder = hf_copy(checkpoints / "hf", tmp_path / "cut", raw_edit=lambda raw: raw[: len(raw) // 2])
    with pytest.raises(WeightsError, match="damaged or incomplete"):
        load_hf_folder(folder)


# ---- where weights come from when none are named ---------------------------------------------------

def fake_hub_cache(root: Path) -> Path:
    snapshot = root / "models--facebook--sam3" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (root / "models--facebook--sam3" / "refs").mkdir()
    (root / "models--facebook--sam3" / "refs" / "main").write_text("abc123")
    return snapshot


def test_sam3_without_weights_uses_the_hub_cache(tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    settings = load_settings(profile="sam3", device="cpu")
    assert settings.profile == "sam3" and Path(settings.weights) == snapshot and settings.notice is None


def test_sam3_without_weights_or_cache_falls_back_to_tiny_with_a_notice(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    settings = load_settings(profile="sam3", device="cpu")
    assert settings.profile == "tiny" and settings.weights == "random"
    assert "weights=PATH" in settings.notice and "\n" not in settings.notice


def test_doit_prints_the_fallback_notice(tmp_path):
    repo = copy_repo(tmp_path)
    env_cache = tmp_path / "empty-cache"
    env_cache.mkdir()
    proc = subprocess.run([sys.executable, "-m", "doit", "list", "profile=sam3"], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(repo / "src"), "HF_HUB_CACHE": str(env_cache)})
    assert proc.returncode == 0
    assert "building profile=tiny" in proc.stderr


# ---- tokenizer files shipped with a checkpoint -------------------------------------------------------

def test_checkpoint_tokenizer_files_are_used_and_checked(tmp_path):
    bundled = read_merges_text()
    hf_tokenizer_files(tmp_path, bundled)
    text, source = checkpoint_merges(tmp_path)
    assert source.name == "merges.txt"
    assert ClipTokenizer(text)(["a truck"]) == ClipTokenizer(bundled)(["a truck"])
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    vocab["truck</w>"] += 1
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(Exception, match="does not match the merges"):
        checkpoint_merges(tmp_path)


def test_tokenizer_json_merges(tmp_path):
    merges = read_merges_text().split("\n")[1 : 49152 - 256 - 2 + 1]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": [m.split() for m in merges]}}))
    text, source = checkpoint_merges(tmp_path)
    assert source.name == "tokenizer.json"
    assert ClipTokenizer(text)(["solar panels"]) == ClipTokenizer.bundled()(["solar panels"])


@pytest.mark.slow  # a stage process that loads transformers: 8 s
def test_weights_stage_takes_an_hf_folder_and_its_tokenizer(checkpoints, tmp_path):
    hf_tokenizer_files(checkpoints / "hf", read_merges_text())
    repo = copy_repo(tmp_path)  # profile sam3 on the tiny architecture: the checkpoint's own
    config = repo / "pipeline.toml"
    config.write_text(config.read_text().replace('architecture = "full"', 'architecture = "tiny"'))
    assert 'architecture = "full"' not in config.read_text()
    run_doit(repo, "weights", "profile=sam3", "device=cpu", f"weights={checkpoints / 'hf'}")
    manifest = json.loads((repo / "artifacts" / "sam3-fp32-cpu" / "manifest.json").read_text())
    assert manifest["stages"]["weights"]["tokenizer"].endswith("merges.txt")
    assert (repo / "artifacts" / "sam3-fp32-cpu" / "weights" / "tokenizer_merges.txt").read_text().startswith("#version")


def test_a_checkpoint_of_another_architecture_is_refused_by_name(checkpoints):
    """The tiny checkpoints under profile=sam3 (the full architecture): refused before any weight is read."""
    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.pipeline.settings import load_settings

    with pytest.raises(WeightsError, match=r"hf is a SAM3 checkpoint of another architecture than `full`: .* wrongly shaped"):
        build_model(load_settings(profile="sam3", device="cpu", weights=str(checkpoints / "hf")))
    with pytest.raises(WeightsError, match=r"does not fit SAM3's `full` architecture .* wrongly shaped"):
        build_model(load_settings(profile="sam3", device="cpu", weights=str(checkpoints / "sam3.pt")))
    (checkpoints / "other").mkdir(exist_ok=True)
    (checkpoints / "other" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(WeightsError, match="is not a SAM3 config"):
        build_model(load_settings(profile="sam3", device="cpu", weights=str(checkpoints / "other")))


@pytest.mark.slow  # a stage process that loads transformers: 8 s
def test_weights_stage_rejects_a_mismatched_meta_checkpoint_in_one_line(checkpoints, tmp_path):
    repo = copy_repo(tmp_path)  # the tiny Meta checkpoint does not fit the full SAM3 architecture
    proc = run_doit(repo, "weights", "profile=sam3", "device=cpu", f"weights={checkpoints / 'sam3.pt'}", check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "does not fit SAM3" in line]
    assert len(errors) == 1 and "wrongly shaped" in errors[0]
    assert not (repo / "artifacts" / "sam3-fp32-cpu" / "weights" / "checkpoint").exists()
