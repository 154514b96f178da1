"""SAM3's text tokenizer (CLIP BPE, context 32) with no network and no transformers.

Ids equal those of Meta's tokenizer (`sam3/model/tokenizer_ve.py`, a copy of open_clip's `SimpleTokenizer`):
the text is cleaned as Meta cleans it (`ftfy.fix_text`, HTML unescaped twice, whitespace runs collapsed, lower
case), then `<start_of_text>` 49406, words, `<end_of_text>` 49407 (Meta's spelling: a prompt holding that
literal text gets the special id), then 0 padding; past 30 words the rest is dropped, as Meta does.
`tests/fixtures/meta_tokenizer_ids.json` holds Meta's ids for a few hundred prompts; the tests compare.
The merges come from the checkpoint's tokenizer files when given, else from the CLIP vocabulary shipped inside
this package (`runtime/vocab/bpe_simple_vocab_16e6.txt.gz`, MIT, see the LICENSE beside it).
Without `regex` the words are split by `split_words_stdlib`, which finds what Meta's pattern finds (tested on
the fixture and on random text). Without `ftfy`, text that ftfy would repair (mojibake, ligatures, full-width
letters, curly quotes) gets other ids, with a warning.
"""

from __future__ import annotations

import functools
import gzip
import html
import json
import logging
import re
import unicodedata
from pathlib import Path

from ..errors import ConfigError, InputError

log = logging.getLogger(__name__)

START, END, PAD = 49406, 49407, 0
CONTEXT_LENGTH = 32
VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
# Tokenizer files a checkpoint folder may carry (HF's, then Meta's), read by `checkpoint_merges`.
CHECKPOINT_TOKENIZER_FILES = ("merges.txt", "tokenizer.json", "vocab.json", VOCAB_FILE)
_NUM_MERGES = 49152 - 256 - 2
SPECIAL_TOKENS = ("<start_of_text>", "<end_of_text>")  # Meta's spelling (CLIP's was <|startoftext|>)
_LITERALS = "|".join(SPECIAL_TOKENS) + r"|'s|'t|'re|'ve|'m|'ll|'d"
# Unicode's White_Space, what `regex`'s \s matches (the standard library's \s also takes \x1c-\x1f).
_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
         "\u2028\u2029\u202f\u205f\u3000"
_STDLIB_LITERALS = re.compile(_LITERALS, re.IGNORECASE)
_WHITESPACE = re.compile(f"[{_SPACE}]+")  # Meta's regex.sub(r"\s+", " ", ...)
try:
    import regex

    _PATTERN = regex.compile(_LITERALS + r"|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+", regex.IGNORECASE)
except ImportError:
    _PATTERN = None


def _kind(char: str) -> str:
    if char in _SPACE:
        return " "
    major = unicodedata.category(char)[0]  # L: letter, N: number
    return major if major in "LN" else "other"


def split_words_stdlib(text: str) -> list[str]:
    """What Meta's pattern (`<start_of_text>|...|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+`) finds, without
    `regex`: at each position the literals first, then a run of letters, one number, or a run of the rest."""
    words, i = [], 0
    while i < len(text):
        if literal := _STDLIB_LITERALS.match(text, i):
            words.append(literal.group())
            i = literal.end()
            continue
        kind, j = _kind(text[i]), i + 1
        if kind == " ":
            i = j
            continue
        if kind != "N":
            while j < len(text) and _kind(text[j]) == kind:
                j += 1
        words.append(text[i:j])
        i = j
    return words


def split_words(text: str) -> list[str]:
    return _PATTERN.findall(text) if _PATTERN is not None else split_words_stdlib(text)


try:
    from ftfy import fix_text
except ImportError:
    fix_text = None


def clean(text: str) -> str:
    """Meta's `_clean_lower`: ftfy, HTML unescaped twice, whitespace collapsed, lower case."""
    if fix_text is not None:
        text = fix_text(text)
    elif not text.isascii():
        _warn_without_ftfy()
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip().lower()


@functools.lru_cache(maxsize=1)
def _warn_without_ftfy() -> None:
    log.warning("ftfy is not installed: prompts with curly quotes, ligatures, full-width letters or mojibake get "
                "other ids than Meta's tokenizer gives; install ftfy")


def bundled_vocab_path() -> Path:
    """The CLIP BPE merges file shipped as package data (a wheel is always unpacked: a real path)."""
    path = Path(__file__).with_name("vocab") / VOCAB_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing: reinstall sam3-aoti (the wheel ships it as package data)")
    return path


def read_merges_text(path: Path | None = None) -> str:
    path = path or bundled_vocab_path()
    raw = path.read_bytes()
    return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")


def checkpoint_merges(folder: Path) -> tuple[str, Path] | None:
    """The merges shipped with a checkpoint: HF's `merges.txt` or `tokenizer.json`, or Meta's BPE file.
    Checked against the checkpoint's `vocab.json` when there is one. None when the folder has none."""
    if (folder / "merges.txt").is_file():
        text, source = read_merges_text(folder / "merges.txt"), folder / "merges.txt"
    elif (folder / "tokenizer.json").is_file():
        source = folder / "tokenizer.json"
        try:
            merges = json.loads(source.read_text())["model"]["merges"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{source} is not a BPE tokenizer.json (no model.merges): remove it or fix it") from None
        lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
        text = "#version: 0.2\n" + "\n".join(lines) + "\n"
    elif (folder / VOCAB_FILE).is_file():
        text, source = read_merges_text(folder / VOCAB_FILE), folder / VOCAB_FILE
    else:
        return None
    tokenizer = ClipTokenizer(text, source=source)
    if (folder / "vocab.json").is_file():
        vocab = json.loads((folder / "vocab.json").read_text())
        words = {t: i for t, i in tokenizer.encoder.items() if i < START}  # special tokens: any spelling
        specials = sorted(i for i in vocab.values() if i >= START)
        if {t: i for t, i in vocab.items() if i < START} != words or specials != [START, END]:
            raise ConfigError(f"{folder / 'vocab.json'} does not match the merges in {source.name}: "
                              "the checkpoint's tokenizer files disagree; copy them again")
    return text, source


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class ClipTokenizer:
    def __init__(self, merges_text: str, source: Path | str = "the BPE merges file"):
        merges = [tuple(line.split()) for line in merges_text.split("\n")[1 : _NUM_MERGES + 1]]
        vocab = list(_bytes_to_unicode().values())
        vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + list(SPECIAL_TOKENS)
        self.encoder = {token: i for i, token in enumerate(vocab)}
        if [self.encoder.get(t) for t in SPECIAL_TOKENS] != [START, END]:
            raise ConfigError(f"{source} is not CLIP's 49408-token BPE vocabulary (SAM3's): "
                              "use the checkpoint's own merges.txt or bpe_simple_vocab_16e6.txt.gz")
        self.ranks = {m: i for i, m in enumerate(merges)}
        self._cache: dict[str, list[str]] = {t: [t] for t in SPECIAL_TOKENS}  # never split, as in Meta's

    @classmethod
    def bundled(cls) -> "ClipTokenizer":
        return cls(read_merges_text())

    def _bpe(self, token: str) -> list[str]:
        if token in self._cache:
            return self._cache[token]
        word = list(token[:-1]) + [token[-1] + "</w>"]
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        self._cache[token] = word
        return word

    def encode(self, text: str) -> list[int]:
        byte_map = _bytes_to_unicode()
        ids = []
        for piece in split_words(clean(text)):
            piece = "".join(byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self._bpe(piece))
        return ids

    def __call__(self, prompts: list[str]) -> list[list[int]]:
        """Rows of CONTEXT_LENGTH ids: start, words (truncated, with a warning), end, zeros."""
        if isinstance(prompts, str) or not prompts:
            raise InputError(f"prompts must be a non-empty list of strings, got {prompts!r}")
        rows = []
        for prompt in prompts:
            words = self.encode(prompt) if isinstance(prompt, str) else []
            if not words:
                raise InputError(f"prompt {prompt!r} is empty: give a noun phrase such as \"a solar panel\"")
            if len(words) > CONTEXT_LENGTH - 2:
                log.warning("prompt %r is %d tokens long; the model reads %d: the last %d are dropped",
                            prompt, len(words), CONTEXT_LENGTH - 2, len(words) - CONTEXT_LENGTH + 2)
                words = words[: CONTEXT_LENGTH - 2]
            row = [START, *words, END]
            rows.append(row + [PAD] * (CONTEXT_LENGTH - len(row)))
        return rows


def encode_prompts(prompts: list[str], merges_text: str | None = None):
    """`list[str]` -> int64 tensor `[P, 32]`, the package's `token_ids` input."""
    import torch

    tokenizer = ClipTokenizer(merges_text) if merges_text else ClipTokenizer.bundled()
    return torch.tensor(tokenizer(prompts), dtype=torch.long)
