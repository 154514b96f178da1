"""The folder `segment` writes, resumable and exactly once:

    DIR/segment.json                  the run's settings (package, prompts, boxes, threshold): a resumed run
                                      must match them
    DIR/instances/part-RUN-SEQ.parquet  one row per instance (source, width, height, prompt, query, score,
                                      box_xyxy, mask_area, mask_counts: COCO RLE of the mask at the image's size)
    DIR/images/part-RUN-SEQ.parquet   one row per image segmented (with no instances too): the commit record
    DIR/errors/part-RUN-SEQ.parquet   the files that could not be segmented, each once across runs (until one
                                      segments it), with the one-line reason

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

from ..errors import ConfigError, Sam3AotiError, first_line
from .schemas import INSTANCE_COLUMNS, errors_schema, images_schema, instances_schema, segmented_schema

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
        self.pending: list = []  # Arrow tables of segmented images not yet in a part
        self.pending_images = 0
        self.errors = []
        self.failed_sources = set()
        self.written = 0
        self.failed = 0
        try:
            self._open(settings)
            self.done = self._committed()
        except OSError as e:
            raise self._cannot_write(e) from None

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
        elif self.folder.is_dir() and any(p.name != ".lock" for p in self.folder.iterdir()):
            raise ConfigError(f"{self.folder} is not empty and holds no segment run: pass a new or empty folder")
        self._hold()
        for name in ("instances", "images", "errors"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        if not record.is_file():
            tmp = record.with_name(f".segment.json.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_text(json.dumps(settings, indent=2) + "\n")
            os.replace(tmp, record)

    def _hold(self) -> None:
        """One writer per output: DIR/.lock, held while this run lives (the kernel lets go when it ends, however it
        ends); a second run into DIR refuses in one line naming the first."""
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / ".lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise ConfigError(f"{self.folder} is being written by another segment run ({holder}): let it end, or "
                              "pass another --output") from None
        self._lock.truncate(0)
        self._lock.write(f"pid {os.getpid()}")
        self._lock.flush()

    def close(self) -> None:
        """This run is over: the next one may write."""
        self._lock.close()

    def _committed(self) -> set[str]:
        """The sources of committed parts; uncommitted instances files and temporaries removed."""
        import pyarrow.parquet as pq

        committed = {p.name for p in (self.folder / "images").glob("part-*.parquet")}
        for folder in ("instances", "images", "errors"):
            for path in (self.folder / folder).iterdir():
                if path.name.endswith(".tmp") or (folder == "instances" and path.name not in committed):
                    path.unlink()
        done = set()
        self.damaged = []  # committed parts that do not read: removed, their images segmented again
        for name in sorted(committed):
            try:
                pq.ParquetFile(self.folder / "instances" / name).metadata  # its footer: truncated, empty, not Parquet
                done.update(pq.read_table(self.folder / "images" / name, columns=["source"]).column(0).to_pylist())
            except Exception as e:  # pyarrow's ArrowInvalid, OSError
                self.damaged.append(f"{name} ({first_line(e)})")
                for folder in ("images", "instances"):  # the commit record first: never half a part believed
                    (self.folder / folder / name).unlink(missing_ok=True)
        self.listed_errors = self._prune_errors(done)
        return done

    def _prune_errors(self, done: set[str]) -> set[str]:
        """errors/ with each failing file once: rows of images committed since, and second rows of one file, are
        dropped (a part rewritten whole, through a temporary name). Returns the files it still lists."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        listed = set()
        for path in sorted((self.folder / "errors").glob("part-*.parquet")):
            try:
                rows = pq.read_table(path).to_pylist()
            except Exception as e:  # a damaged list of errors: its files are tried again, and listed again
                self.damaged.append(f"errors/{path.name} ({first_line(e)})")
                path.unlink()
                continue
            keep = [r for r in rows if r["source"] not in done and r["source"] not in listed]
            listed.update(r["source"] for r in keep)
            if len(keep) < len(rows):
                if keep:
                    self._write(pa.Table.from_pylist(keep, schema=errors_schema()), "errors", path.name)
                else:
                    path.unlink()
        return listed

    def add(self, table) -> None:
        """Results of segmented images (`schemas.segmented_schema`): errors listed, the rest committed a part at a
        time, kept as Arrow (never Python rows). An image seen already (committed by an earlier run, or
        delivered twice) is left out."""
        keep = []
        for i, (source, error) in enumerate(zip(table.column("source").to_pylist(), table.column("error").to_pylist())):
            if source in self.done or source in self.failed_sources:
                continue
            if error:
                self.failed_sources.add(source)
                self.failed += 1
                if source not in self.listed_errors:  # an earlier run listed it: once is enough
                    self.errors.append({"source": source, "error": error})
                continue
            self.done.add(source)
            keep.append(i)
        if keep:
            self.pending.append(table.take(keep).cast(segmented_schema()))
            self.pending_images += len(keep)
        if self.pending_images >= self.part_images:
            self.flush()

    def flush(self) -> None:
        """The pending images as one committed part, and the errors seen since the last part."""
        import pyarrow as pa
        import pyarrow.compute as pc

        name = f"part-{self.run}-{self.seq:05d}.parquet"
        if self.pending:
            images = pa.concat_tables(self.pending).combine_chunks()
            found = images.column("instances").chunk(0) if images.num_rows else pa.array([], images.schema.field("instances").type)
            per_image = images.select(["source", "width", "height"]).take(pc.list_parent_indices(found))
            instances = pc.list_flatten(found)
            columns = [per_image.column(n) for n in ("source", "width", "height")]
            columns += [pc.struct_field(instances, n) for n in INSTANCE_COLUMNS[3:]]
            self._write(pa.Table.from_arrays(columns, schema=instances_schema()), "instances", name)
            counts = pc.cast(pc.list_value_length(found), pa.int32())
            table = pa.Table.from_arrays([images.column("source"), images.column("width"), images.column("height"),
                                          counts, images.column("seconds")], schema=images_schema())
            self._write(table, "images", name)  # the commit
            self.written += images.num_rows
            if self.listed_errors & set(images.column("source").to_pylist()):  # failed before, segmented now
                self.listed_errors = self._prune_errors(self.done)
        if self.errors:
            self._write(pa.Table.from_pylist(self.errors, schema=errors_schema()), "errors", name)
        if self.pending or self.errors:
            self.seq += 1
        self.pending, self.pending_images, self.errors = [], 0, []

    def _write(self, table, folder: str, name: str) -> None:
        import pyarrow.parquet as pq

        target = self.folder / folder / name
        tmp = target.with_name(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            pq.write_table(table, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:  # nothing half-written: the temporary goes, what was committed stays
            tmp.unlink(missing_ok=True)
            raise self._cannot_write(e) from None

    def _cannot_write(self, e: OSError) -> Sam3AotiError:
        return Sam3AotiError(f"cannot write under --output {self.folder}: {e.strerror or e} ({e.filename or self.folder}); "
                             "free space or make it writable, then run again (what was committed is kept)")


def read_instances(folder: Path):
    """Every instance DIR holds, as one Arrow table (pyarrow.parquet reads the folder as a dataset)."""
    import pyarrow.parquet as pq

    return pq.read_table(Path(folder) / "instances", schema=instances_schema())
