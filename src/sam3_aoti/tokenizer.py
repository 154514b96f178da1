"""SAM3's text tokenizer (CLIP BPE, context 32) with no network and no transformers.

Ids equal SAM3's own: `<|startoftext|>` 49406, words, `<|endoftext|>` 49407, then 0 padding. The merges
come from the checkpoint's tokenizer files when given, else from the CLIP vocabulary that the
open-clip-torch wheel ships (`bpe_simple_vocab_16e6.txt.gz`); the file is read, the package never imported.
Needs only the standard library (and torch for `encode_prompts`): with the `regex` module the word
splitter is CLIP's own pattern, without it an `re` equivalent that differs only on rare numerals (e.g. "½").
"""

from __future__ import annotations

import functools
import gzip
import html
import json
import re
from importlib import metadata
from pathlib import Path

import logging

from .errors import ConfigError, InputError

log = logging.getLogger("sam3_aoti")

START, END, PAD = 49406, 49407, 0
CONTEXT_LENGTH = 32
VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
# Tokenizer files a checkpoint folder may carry (HF's, then Meta's), read by `checkpoint_merges`.
CHECKPOINT_TOKENIZER_FILES = ("merges.txt", "tokenizer.json", "vocab.json", VOCAB_FILE)
_NUM_MERGES = 49152 - 256 - 2
_SPECIAL = r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|"
# Without `regex` (a torch-only consumer): letters = word characters minus digits and "_".
STDLIB_PATTERN = re.compile(_SPECIAL + r"[^\W\d_]+|\d|(?:[^\s\w]|_)+", re.IGNORECASE)
try:
    import regex

    _PATTERN = regex.compile(_SPECIAL + r"[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+", regex.IGNORECASE)
except ImportError:
    _PATTERN = STDLIB_PATTERN


def bundled_vocab_path() -> Path:
    """The CLIP BPE merges file inside the installed open-clip-torch wheel."""
    try:
        files = metadata.files("open-clip-torch") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == VOCAB_FILE:
            return Path(f.locate())
    raise ConfigError(f"{VOCAB_FILE} not found: install the project's dependencies (uv sync) for open-clip-torch")


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
        if vocab != tokenizer.encoder:
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
        vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
        self.encoder = {token: i for i, token in enumerate(vocab)}
        if self.encoder.get("<|startoftext|>") != START or self.encoder.get("<|endoftext|>") != END:
            raise ConfigError(f"{source} is not CLIP's 49408-token BPE vocabulary (SAM3's): "
                              "use the checkpoint's own merges.txt or bpe_simple_vocab_16e6.txt.gz")
        self.ranks = {m: i for i, m in enumerate(merges)}
        self._cache: dict[str, str] = {}

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
        text = " ".join(html.unescape(html.unescape(text)).split()).lower()
        byte_map = _bytes_to_unicode()
        ids = []
        for piece in _PATTERN.findall(text):
            piece = "".join(byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self._bpe(piece))
        return ids

    def __call__(self, prompts: list[str]) -> list[list[int]]:
        """Rows of CONTEXT_LENGTH ids: start, words (truncated, with a warning), end, zeros."""
        if isinstance(prompts, str) or not prompts:
            raise InputError(f"prompts must be a non-empty list of strings, got {prompts!r}")
        rows = []
        for prompt in prompts:
            if not isinstance(prompt, str) or not prompt.strip():
                raise InputError(f"prompt {prompt!r} is empty: give a noun phrase such as \"a solar panel\"")
            words = self.encode(prompt)
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
