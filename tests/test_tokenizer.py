"""Offline CLIP BPE: ids equal SAM3's own (start 49406, end 49407, pad 0, context 32)."""

import json

import pytest

from sam3_aoti.tokenizer import CONTEXT_LENGTH, ClipTokenizer, _bytes_to_unicode, encode_prompts, read_merges_text


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

    merges_text = read_merges_text()
    merges = merges_text.split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    reference = CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in ["a truck", "solar panels on a roof", "Swimming-pool, 2 boats!", "café", "a red car's wheel"]:
        want = reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text) == want, text


def test_encode_prompts_tensor():
    ids = encode_prompts(["a cat", "a dog"])
    assert ids.shape == (2, CONTEXT_LENGTH) and str(ids.dtype) == "torch.int64"
