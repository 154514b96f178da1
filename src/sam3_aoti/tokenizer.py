"""SAM3's text tokenizer (CLIP BPE, context 32) with no network and no transformers.

Ids equal SAM3's own: `<|startoftext|>` 49406, words, `<|endoftext|>` 49407, then 0 padding. The merges
come from the checkpoint's tokenizer files when given, else from the CLIP vocabulary that the
open-clip-torch wheel ships (`bpe_simple_vocab_16e6.txt.gz`); the file is read, the package never imported.
"""

from __future__ import annotations

import functools
import gzip
import html
from importlib import metadata
from pathlib import Path

import regex

from .errors import ConfigError

START, END, PAD = 49406, 49407, 0
CONTEXT_LENGTH = 32
VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
_NUM_MERGES = 49152 - 256 - 2
_PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE,
)


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
    def __init__(self, merges_text: str):
        merges = [tuple(line.split()) for line in merges_text.split("\n")[1 : _NUM_MERGES + 1]]
        vocab = list(_bytes_to_unicode().values())
        vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
        self.encoder = {token: i for i, token in enumerate(vocab)}
        if self.encoder.get("<|startoftext|>") != START or self.encoder.get("<|endoftext|>") != END:
            raise ConfigError("the BPE merges file is not CLIP's 49408-token vocabulary: use bpe_simple_vocab_16e6")
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
        """Rows of CONTEXT_LENGTH ids: start, words (truncated), end, zeros."""
        rows = []
        for prompt in prompts:
            words = self.encode(prompt)[: CONTEXT_LENGTH - 2]
            row = [START, *words, END]
            rows.append(row + [PAD] * (CONTEXT_LENGTH - len(row)))
        return rows


def encode_prompts(prompts: list[str], merges_text: str | None = None):
    """`list[str]` -> int64 tensor `[P, 32]`, the package's `token_ids` input."""
    import torch

    tokenizer = ClipTokenizer(merges_text) if merges_text else ClipTokenizer.bundled()
    return torch.tensor(tokenizer(prompts), dtype=torch.long)
