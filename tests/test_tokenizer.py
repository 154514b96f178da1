"""Offline CLIP BPE: ids equal SAM3's own (start 49406, end 49407, pad 0, context 32)."""

import pytest

from sam3_aoti.tokenizer import CONTEXT_LENGTH, ClipTokenizer, encode_prompts, read_merges_text

from conftest import hf_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer():
    return ClipTokenizer.bundled()


def test_known_clip_ids(tokenizer):
    # Published CLIP ids: "a photo of a dog" and the sentinels.
    assert tokenizer.encode("a photo of a dog") == [320, 1125, 539, 320, 1929]
    row = tokenizer(["A  Photo of a DOG"])[0]
    assert row[:7] == [49406, 320, 1125, 539, 320, 1929, 49407]
    assert row[7:] == [0] * (CONTEXT_LENGTH - 7)


def test_long_prompts_truncate_and_keep_the_end_token(tokenizer):
    row = tokenizer(["truck " * 50])[0]
    assert len(row) == CONTEXT_LENGTH and row[0] == 49406 and row[-1] == 49407


def test_matches_transformers_clip_tokenizer(tmp_path, tokenizer):
    """transformers' own CLIP tokenizer, fed the same vocabulary, gives the same ids."""
    from transformers import CLIPTokenizer

    hf_tokenizer_files(tmp_path, read_merges_text())
    reference = CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in ["a truck", "solar panels on a roof", "Swimming-pool, 2 boats!", "café", "a red car's wheel"]:
        want = reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text) == want, text


def test_encode_prompts_tensor():
    ids = encode_prompts(["a cat", "a dog"])
    assert ids.shape == (2, CONTEXT_LENGTH) and str(ids.dtype) == "torch.int64"
