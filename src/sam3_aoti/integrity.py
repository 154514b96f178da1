"""Is this the package its build wrote? Checked before any shared object in it is loaded: a .pt2 holds native
code, and loading a package runs it. Imports no torch.

Two records, written by the `package` stage: `sam3.pt2.sha256` beside the archive (the whole file, in
`sha256sum` format) and, inside the metadata, the sha256 of every compiled part (code and weights), for a
package that travels without its digest file.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from .artifacts import sha256, stream_sha256, write_text_atomic
from .errors import PackageError
from .paths import archive_entries

AOTI_PREFIX = "data/aotinductor/"


def digest_file(package: Path) -> Path:
    package = Path(package)
    return package.with_name(f"{package.name}.sha256")


def write_digest(package: Path) -> None:
    write_text_atomic(digest_file(package), f"{sha256(package)}  {Path(package).name}\n")


def check_package(package: Path, trust: bool = False) -> str:
    """Raise a one-line PackageError unless the archive is what its build recorded; returns how it was
    checked. `trust` loads a package that carries no digest at all (never one that mismatches)."""
    package = Path(package)
    recorded = digest_file(package)
    if recorded.is_file():
        if sha256(package) != (recorded.read_text().split() or [""])[0]:
            raise PackageError(f"{package} does not match its digest {recorded.name}: it was modified or damaged "
                               "since it was built; rebuild it (`uv run doit package`) or fetch it again")
        return f"matches {recorded.name}"
    try:
        with zipfile.ZipFile(package) as archive:
            entries = archive_entries(archive)
            metadata = json.loads(archive.read(entries["extra/metadata.json"]))
            parts = metadata.get("parts_sha256")
            if not parts:
                if trust:
                    return "no digest (trusted)"
                raise PackageError(f"{package} carries no digest ({recorded.name} beside it, or parts_sha256 in its "
                                   "metadata): load it only if you vouch for it (--trust / trust=True)")
            code = [name for name in entries if name.startswith(AOTI_PREFIX)]
            for name in code:
                if name not in parts:
                    raise PackageError(f"{package} holds {name}, which its build did not write: refusing to load it")
                with archive.open(entries[name]) as part:
                    digest = stream_sha256(part)
                if digest != parts[name]:
                    raise PackageError(f"{package}: {name} does not match its recorded digest: the package was "
                                       "modified; rebuild it (`uv run doit package`) or fetch it again")
            missing = sorted(set(parts) - set(code))
            if missing:
                raise PackageError(f"{package} lacks {missing[0]}, which its build wrote: rebuild it")
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError):
        raise PackageError(f"{package} is truncated or not a sam3-aoti package: rebuild it with `uv run doit package`") from None
    return "parts match the metadata's digests"
