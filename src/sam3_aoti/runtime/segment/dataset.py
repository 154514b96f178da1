"""The folder `segment` writes, resumable and exactly once:

    DIR/segment.json                  the run's settings (package, prompts, boxes, threshold): a resumed run
                                      must match them
    DIR/instances/part-RUN-SEQ.parquet  one row per instance (source, width, height, prompt, query, score,
                                      box_xyxy, mask_area, mask_counts: COCO RLE of the mask at the image's size)
    DIR/images/part-RUN-SEQ.parquet   one row per image segmented (with no instances too): the commit record
    DIR/errors/part-RUN-SEQ.parquet   the files that could not be segmented, with the one-line reason

One process writes (the driver), a part at a time: its instances file, then its images file, each through a
temporary name renamed into place. A part is committed when its images file exists; a resumed run first removes
the instances files of parts that were not committed (a run killed between the two renames), then skips every
image a committed part holds. An image is in at most one committed part, so each instance is written once.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from ...errors import ConfigError

INSTANCE_COLUMNS = ("source", "width", "height", "prompt", "query", "score", "box_xyxy", "mask_area", "mask_counts")


def instances_schema():
    import pyarrow as pa

    from .worker import instance_type

    inner = {field.name: field.type for field in instance_type()}
    return pa.schema([("source", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                      *((name, inner[name]) for name in INSTANCE_COLUMNS[3:])])


def images_schema():
    import pyarrow as pa

    return pa.schema([("source", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                      ("instances", pa.int32()), ("seconds", pa.float64())])


def errors_schema():
    import pyarrow as pa

    return pa.schema([("source", pa.string()), ("error", pa.string())])


def new_run_id() -> str:
    """A run's name: when it began, and a random tail for two runs begun in one second."""
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


class Output:
    """DIR as the driver of one run sees it: what earlier runs committed (`done`), and `add` for new results."""

    def __init__(self, folder: Path, settings: dict, part_images: int = 256, run: str | None = None):
        self.folder = Path(folder)
        self.run = run or new_run_id()
        self.part_images = part_images
        self.seq = 0
        self.pending = []  # rows of segmented images not yet in a part
        self.errors = []
        self.failed_sources = set()
        self.written = 0
        self.failed = 0
        self._open(settings)
        self.done = self._committed()

    def _open(self, settings: dict) -> None:
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"--output {self.folder} is a file: pass a folder")
        record = self.folder / "segment.json"
        if record.is_file():
            try:
                before = json.loads(record.read_text())
            except (OSError, ValueError):
                before = None
            if before != settings:
                changed = sorted(k for k in settings if not isinstance(before, dict) or before.get(k) != settings[k])
                raise ConfigError(f"{self.folder} holds a run with other settings ({', '.join(changed) or 'unreadable'}"
                                  "): pass another --output, or the same settings to resume it")
        elif self.folder.is_dir() and any(self.folder.iterdir()):
            raise ConfigError(f"{self.folder} is not empty and holds no segment run: pass a new or empty folder")
        for name in ("instances", "images", "errors"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        if not record.is_file():
            tmp = record.with_name(f".segment.json.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_text(json.dumps(settings, indent=2) + "\n")
            os.replace(tmp, record)

    def _committed(self) -> set[str]:
        """The sources of committed parts; uncommitted instances files and temporaries removed."""
        import pyarrow.parquet as pq

        committed = {p.name for p in (self.folder / "images").glob("part-*.parquet")}
        for folder in ("instances", "images", "errors"):
            for path in (self.folder / folder).iterdir():
                if path.name.endswith(".tmp") or (folder == "instances" and path.name not in committed):
                    path.unlink()
        done = set()
        for name in sorted(committed):
            done.update(pq.read_table(self.folder / "images" / name, columns=["source"]).column(0).to_pylist())
        return done

    def add(self, table) -> None:
        """Results of segmented images (`worker.segmented_schema`): errors listed, the rest committed a part at a
        time. An image seen already (committed by an earlier run, or delivered twice) is left out."""
        for row in table.to_pylist():
            if row["source"] in self.done or row["source"] in self.failed_sources:
                continue
            if row["error"]:
                self.failed_sources.add(row["source"])
                self.errors.append({"source": row["source"], "error": row["error"]})
                continue
            self.done.add(row["source"])
            self.pending.append(row)
        if len(self.pending) >= self.part_images:
            self.flush()

    def flush(self) -> None:
        """The pending images as one committed part, and the errors seen since the last part."""
        import pyarrow as pa

        name = f"part-{self.run}-{self.seq:05d}.parquet"
        if self.pending:
            rows = [{"source": r["source"], "width": r["width"], "height": r["height"], **inst}
                    for r in self.pending for inst in r["instances"]]
            self._write(pa.Table.from_pylist(rows, schema=instances_schema()), "instances", name)
            images = [{"source": r["source"], "width": r["width"], "height": r["height"],
                       "instances": len(r["instances"]), "seconds": r["seconds"]} for r in self.pending]
            self._write(pa.Table.from_pylist(images, schema=images_schema()), "images", name)  # the commit
            self.written += len(self.pending)
        if self.errors:
            self._write(pa.Table.from_pylist(self.errors, schema=errors_schema()), "errors", name)
            self.failed += len(self.errors)
        if self.pending or self.errors:
            self.seq += 1
        self.pending, self.errors = [], []

    def _write(self, table, folder: str, name: str) -> None:
        import pyarrow.parquet as pq

        target = self.folder / folder / name
        tmp = target.with_name(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)


def read_instances(folder: Path):
    """Every instance DIR holds, as one Arrow table (pyarrow.parquet reads the folder as a dataset)."""
    import pyarrow.parquet as pq

    return pq.read_table(Path(folder) / "instances", schema=instances_schema())
