"""Offline CLIP BPE with Meta's cleaning: ids equal those of Meta's tokenizer (start 49406, end 49407, pad 0,
context 32) for every prompt of the committed fixture, with or without the `regex` module."""

import json
import logging
from importlib import metadata

import pytest

from sam3_aoti.runtime import tokenizer as tok
from sam3_aoti.runtime.tokenizer import CONTEXT_LENGTH, ClipTokenizer, encode_prompts, read_merges_text

from helpers import REPO, hf_tokenizer_files

FIXTURE = json.loads((REPO / "tests" / "fixtures" / "meta_tokenizer_ids.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return ClipTokenizer.bundled()


def mismatches(tokenizer) -> list[str]:
    return [case["prompt"] for case in FIXTURE["cases"] if tokenizer([case["prompt"]])[0] != case["ids"]]


def test_the_fixture_covers_what_users_type():
    prompts = [case["prompt"] for case in FIXTURE["cases"]]
    assert len(prompts) >= 200
    for needle in ["’", "ﬁ", "ｃａｒ", "e\u0301", "Ã©", "\x00", "&amp;", "<start_of_text>", "½", "🚲"]:
        assert any(needle in p for p in prompts), needle


def test_ids_equal_metas_for_every_fixture_prompt(tokenizer):
    assert mismatches(tokenizer) == []


def test_without_regex_the_ids_are_the_same(tokenizer, monkeypatch):
    monkeypatch.setattr(tok, "_PATTERN", None)
    assert mismatches(ClipTokenizer.bundled()) == []


def test_the_stdlib_splitter_finds_what_metas_pattern_finds_on_random_text():
    import random

    rng = random.Random(0)
    pool = list("abXY '’-_!½²Ⅻ①٣\t\n\x1c\xa0\u3000éü自🚲<>|") + ["'s", "'re", "'ll", "'d", "<start_of_text>", "<end_of_text>"]
    for _ in range(5000):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 12)))
        assert tok.split_words_stdlib(text) == tok._PATTERN.findall(text), repr(text)


def test_the_fixture_is_what_open_clip_gives_today():
    from scripts.fixtures.make_tokenizer_fixture import meta_tokenizer

    try:
        reference = meta_tokenizer()
    except (metadata.PackageNotFoundError, StopIteration, ImportError) as e:
        pytest.skip(f"open_clip's tokenizer is not importable here ({e}); the fixture test still compares")
    rows = reference([case["prompt"] for case in FIXTURE["cases"]]).tolist()
    assert rows == [case["ids"] for case in FIXTURE["cases"]]


def test_metas_special_token_spelling(tokenizer):
    assert tokenizer.encode("<start_of_text>") == [49406] and tokenizer.encode("a <END_OF_TEXT>")[-1] == 49407
    assert 49406 not in tokenizer.encode("<|startoftext|>")  # CLIP's spelling is plain text to Meta


def test_curly_quotes_and_ligatures_get_the_plain_ids(tokenizer):
    assert tokenizer.encode("children’s bike") == tokenizer.encode("children's bike")
    assert tokenizer.encode("ﬁre hydrant") == tokenizer.encode("fire hydrant")
    assert tokenizer.encode("ｃａｒ") == tokenizer.encode("car")


def test_without_ftfy_non_ascii_prompts_warn(tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(tok, "fix_text", None)
    tok._warn_without_ftfy.cache_clear()
    with caplog.at_level(logging.WARNING, logger="sam3_aoti"):
        tokenizer.encode("a car")
        assert "ftfy" not in caplog.text
        tokenizer.encode("children’s bike")
    assert "ftfy is not installed" in caplog.text
    tok._warn_without_ftfy.cache_clear()


def test_a_prompt_that_cleans_to_nothing_is_refused(tokenizer):
    from sam3_aoti.errors import InputError

    for prompt in ["", "   ", "\x00", "\t\x07"]:
        with pytest.raises(InputError, match="is empty"):
            tokenizer([prompt])


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
    """transformers' own CLIP tokenizer, fed the same vocabulary, gives the same ids on plain text."""
    from transformers import CLIPTokenizer

    hf_tokenizer_files(tmp_path, read_merges_text())
    reference = CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in ["a truck", "solar panels on a roof", "Swimming-pool, 2 boats!", "café", "a red car's wheel"]:
        want = reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text) == want, text


def test_encode_prompts_tensor():
    ids = encode_prompts(["a cat", "a dog"])
    assert ids.shape == (2, CONTEXT_LENGTH) and str(ids.dtype) == "torch.int64"
