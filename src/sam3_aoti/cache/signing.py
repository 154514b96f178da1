"""ed25519 keys and signatures in Nix's text forms, so that a key made by `nix-store --generate-binary-cache-key`
works here too: a public key is `NAME:BASE64(32 bytes)`, a secret key `NAME:BASE64(64 bytes: seed, public)`, a
signature `NAME:BASE64(64 bytes)`. The signing itself is pyca/cryptography's (the `cache` extra)."""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, Sam3AotiError

SIGNING_KEY_VARIABLE = "SAM3_AOTI_SIGNING_KEY"  # a secret key file: pushing needs it
TRUSTED_KEYS_VARIABLE = "SAM3_AOTI_TRUSTED_KEYS"  # public keys, space-separated: substituting needs one
KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]*$")


class TrustError(Sam3AotiError):
    """An entry or ref that no trusted key signed (unsigned, unknown signer, or altered after signing)."""


def _ed25519():
    from .store import cache_extra

    return cache_extra("cryptography.hazmat.primitives.asymmetric.ed25519")


def _split(text: str, what: str, sizes: tuple[int, ...]) -> tuple[str, bytes]:
    name, sep, data = text.strip().partition(":")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if not sep or not KEY_NAME.match(name) or len(raw) not in sizes:
        raise ConfigError(f"{what} {text.strip()[:40]!r} is not NAME:BASE64 of an ed25519 key: make one with "
                          "`sam3-aoti cache keygen NAME --out FILE`")
    return name, raw


@dataclass(frozen=True)
class PublicKey:
    name: str
    raw: bytes

    @classmethod
    def parse(cls, text: str) -> "PublicKey":
        return cls(*_split(text, "public key", (32,)))

    def __str__(self) -> str:
        return f"{self.name}:{base64.b64encode(self.raw).decode()}"


@dataclass(frozen=True)
class SecretKey:
    name: str
    seed: bytes

    @classmethod
    def read(cls, path: str | os.PathLike) -> "SecretKey":
        """The key in `path`, refused as ssh refuses a private key others may read (group or world bits set)."""
        try:
            mode = Path(path).stat().st_mode
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"signing key {path} cannot be read ({e.strerror or e}): set {SIGNING_KEY_VARIABLE} "
                              "to a file `sam3-aoti cache keygen` wrote") from None
        if mode & 0o077:
            raise ConfigError(f"signing key {path} is readable by others (mode {mode & 0o777:o}): anyone who can read "
                              f"it can sign for it; run chmod 600 {path}")
        name, raw = _split(text, f"signing key in {path}", (32, 64))
        return cls(name, raw[:32])

    @classmethod
    def generate(cls, name: str) -> "SecretKey":
        if not KEY_NAME.match(name):
            raise ConfigError(f"key name {name!r}: use letters, digits and . _ @ + - (e.g. builder-1.example.org)")
        return cls(name, os.urandom(32))

    def _key(self):
        return _ed25519().Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public(self) -> PublicKey:
        from cryptography.hazmat.primitives import serialization

        raw = self._key().public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return PublicKey(self.name, raw)

    def text(self) -> str:
        """Nix's secret key form: the seed followed by the public key."""
        return f"{self.name}:{base64.b64encode(self.seed + self.public.raw).decode()}"

    def sign(self, message: bytes) -> str:
        return f"{self.name}:{base64.b64encode(self._key().sign(message)).decode()}"


def trusted_keys(configured: list[str] | tuple[str, ...] = ()) -> dict[str, PublicKey]:
    """The keys a substitution may be signed by: the configured ones plus $SAM3_AOTI_TRUSTED_KEYS."""
    texts = [*configured, *os.environ.get(TRUSTED_KEYS_VARIABLE, "").split()]
    keys: dict[str, PublicKey] = {}
    for key in (PublicKey.parse(t) for t in texts):
        if keys.get(key.name, key) != key:  # one name, two keys: which one signs for it is no one's guess
            raise ConfigError(f"two trusted keys are named {key.name}: {keys[key.name]} and {key}; keep the "
                              f"builder's own in [cache] trusted_keys and ${TRUSTED_KEYS_VARIABLE}")
        keys[key.name] = key
    return keys


def signer(signatures: list, message: bytes, trusted: dict[str, PublicKey]) -> str:
    """The name of a trusted key whose signature of `message` is among `signatures`; else TrustError naming why."""
    if not signatures:
        raise TrustError("it is unsigned")
    if not trusted:
        raise TrustError(f"no key is trusted: add the signer's public key to [cache] trusted_keys in pipeline.toml "
                         f"or to ${TRUSTED_KEYS_VARIABLE}")
    names = []
    for signature in signatures:
        name, _, data = str(signature).partition(":")
        names.append(name)
        key = trusted.get(name)
        if key is None:
            continue
        try:
            _ed25519().Ed25519PublicKey.from_public_bytes(key.raw).verify(base64.b64decode(data), message)
            return name
        except Exception:  # cryptography's InvalidSignature, or a signature that is not base64
            raise TrustError(f"its signature by {name} does not match its content (altered after signing)") from None
    raise TrustError(f"it is signed by {', '.join(sorted(set(names)))}, which is not a trusted key")
