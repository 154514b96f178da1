"""The schema of pipeline.toml, checked when doit loads, before any stage runs: a wrong value is one line
naming the file, the key and the fix, not an "unexpected ...Error" minutes into a build. Imports no torch.
(cases.toml is checked by `cases.check_cases`.)

Hand-written rather than pydantic or msgspec: each check is one table row (key, predicate, what the value must
be), the message names the file, the table and the fix in one line, and the doit side stays free of a compiled
dependency it would load on every `doit list`. A library would save the predicates and cost the messages."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .precision import PRECISIONS


def _int(minimum: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _pairs(v) -> bool:
    return isinstance(v, list) and bool(v) and all(_pair(p) for p in v)


def _pair(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_int(1)(x) for x in v)


def _unit(v) -> bool:
    return _number(v) and 0 <= v <= 1


# [bench] columns: each name and its label in bench.md (bench.py reads the labels from here)
BENCH_COLUMNS = {"meta": "Meta sam3 eager (bf16 autocast)", "transformers": "transformers eager",
                 "exported": "exported program", "aoti": "AOTI", "aoti_graphs": "AOTI + CUDA graphs"}
PAIRS = "a list of [batch, prompts] pairs of positive integers, e.g. [[1, 1], [2, 3]]"
# (table, key): (check, what the value must be). Every key here is read by a stage.
PIPELINE_KEYS = {
    ("weights", "seed"): (_int(0), "an integer >= 0"),
    ("export", "example_batch"): (_int(2), "an integer >= 2 (a size-1 example specializes the dim away)"),
    ("export", "example_prompts"): (_int(2), "an integer >= 2 (a size-1 example specializes the dim away)"),
    ("export", "check_batch"): (_int(1), "a positive integer"),
    ("export", "check_prompts"): (_int(1), "a positive integer"),
    ("export", "transforms_example_size"): (lambda v: isinstance(v, list) and len(v) == 4 and v[1:2] == [3]
                                            and all(_int(2)(x) for x in v[:1] + v[2:]),
                                            "[batch, 3, height, width], each other size an integer >= 2"),
    ("export", "masked_attention"): (lambda v: v in ("sdpa", "eager"), '"sdpa" or "eager"'),
    ("export", "box_path_attention"): (lambda v: v in ("fp32", "bf16"), '"fp32" or "bf16"'),
    ("compile", "sdpa_backends"): (lambda v: isinstance(v, list) and bool(v) and len(set(v)) == len(v)
                                  and all(b in ("cudnn", "flash", "efficient", "math") for b in v),
                                  'a list of distinct SDPA kernels from "cudnn", "flash", "efficient", "math"'),
    ("compile", "inductor"): (lambda v: isinstance(v, dict), "a table of torch._inductor.config keys"),
    ("tune", "enabled"): (lambda v: isinstance(v, bool), "true or false"),
    ("tune", "inductor"): (lambda v: isinstance(v, dict), "a table of torch._inductor.config keys"),
    ("verify", "shapes"): (_pairs, PAIRS),
    ("verify", "largest_shape"): (_pair, "one [batch, prompts] pair of positive integers"),
    ("bench", "shapes"): (_pairs, PAIRS),
    ("bench", "warmup"): (_int(0), "an integer >= 0"),
    ("bench", "iters"): (_int(1), "a positive integer"),
    ("bench", "isa_probe_loaders"): (lambda v: isinstance(v, bool), "true or false"),
    ("bench", "columns"): (lambda v: isinstance(v, list) and bool(v) and len(set(v)) == len(v)
                           and all(c in BENCH_COLUMNS for c in v), f"a list of distinct columns from {tuple(BENCH_COLUMNS)}"),
    ("bench", "load_times"): (lambda v: isinstance(v, bool), "true or false"),
    ("render", "score_threshold"): (_unit, "a number between 0 and 1"),
    ("render", "max_instances"): (_int(1), "a positive integer"),
}
TOLERANCES = {
    "max_abs": (_number, "a number"), "pearson_min": (_unit, "a number between 0 and 1"),
    "top1_score_abs": (_number, "a number"), "top5_overlap_min": (_unit, "a number between 0 and 1"),
    "box_abs": (_number, "a number"), "mask_iou_min": (_unit, "a number between 0 and 1"),
}
OPTIONAL_TOLERANCES = {"mask_band": (_number, "a number"), "max_rel": (_number, "a number")}
PER_OUTPUT_TOLERANCES = ("max_abs", "max_rel")
PARITY_TOLERANCES = {"top1_same_min": (_unit, "a number between 0 and 1"), "score_abs": (_number, "a number"), "box_abs": (_number, "a number"),
                     "top5_overlap_min": (_unit, "a number between 0 and 1"),
                     "mask_iou_min": (_unit, "a number between 0 and 1"), "pixels_max_levels": (_number, "a number")}
ARCHITECTURES = ("tiny", "full")
PARITY_PRECISIONS = tuple(name for name, p in PRECISIONS.items() if p.parity)  # Meta has no fp8
RANDOM_INIT = {"bias_noise": (lambda v: _number(v) and v >= 0, "a number >= 0")}
OPTIONAL_RANDOM_INIT = {"matrix_gain": (lambda v: _number(v) and v > 0, "a number > 0")}


def _check(path: Path, where: str, table: dict, key: str, spec: tuple, required: bool = True) -> None:
    check, expected = spec
    if key not in table:
        if required:
            raise ConfigError(f"{path} [{where}] has no `{key}`: add it ({expected})")
        return
    if not check(table[key]):
        raise ConfigError(f"{path} [{where}] {key} must be {expected}, got {table[key]!r}: fix the file")


def _table(path: Path, tables: dict, name: str) -> dict:
    value = tables
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            raise ConfigError(f"{path} has no [{name}] table: restore it from the repository's pipeline.toml")
    return value


def check_pipeline(path: Path, tables: dict, profiles: tuple, precisions: tuple) -> None:
    """Every key a stage reads: present, of the right type and range."""
    profile_tables = _table(path, tables, "profiles")
    for name in profiles:
        profile = _table(path, tables, f"profiles.{name}")
        _check(path, f"profiles.{name}", profile, "architecture",
               (lambda v: v in ARCHITECTURES, f"one of {', '.join(ARCHITECTURES)}"))
        _check(path, f"profiles.{name}", profile, "precision",
               (lambda v: v in precisions, f"one of {', '.join(precisions)}"), required=False)
    unknown = sorted(set(profile_tables) - set(profiles))
    if unknown:
        raise ConfigError(f"{path} [profiles.{unknown[0]}] is not a profile this pipeline builds: "
                          f"keep {', '.join(profiles)}")
    for (name, key), spec in PIPELINE_KEYS.items():
        _check(path, name, _table(path, tables, name), key, spec)
    for architecture in ARCHITECTURES:
        where = f"weights.random_init.{architecture}"
        for key, spec in RANDOM_INIT.items():
            _check(path, where, _table(path, tables, where), key, spec)
        for key, spec in OPTIONAL_RANDOM_INIT.items():
            _check(path, where, _table(path, tables, where), key, spec, required=False)
    tolerances = _table(path, tables, "verify.tolerances")
    for precision in sorted(tolerances):
        if precision not in precisions:
            raise ConfigError(f"{path} [verify.tolerances.{precision}]: no such precision, use {', '.join(precisions)}")
        where = f"verify.tolerances.{precision}"
        table = _table(path, tables, where)
        for key, spec in TOLERANCES.items():
            _check(path, where, table, key, spec)
        for key, spec in OPTIONAL_TOLERANCES.items():
            _check(path, where, table, key, spec, required=False)
        check_per_output(path, where, table)
    # parity compares a build with Meta's model run the same way; Meta has no fp8 (verify gates fp8 against bf16)
    for precision in PARITY_PRECISIONS:
        where = f"parity.tolerances.{precision}"
        for key, spec in PARITY_TOLERANCES.items():
            _check(path, where, _table(path, tables, where), key, spec)
        _check(path, where, _table(path, tables, where), "mask_band", (_number, "a number"), required=False)


def check_per_output(path: Path, where: str, table: dict) -> None:
    """[verify.tolerances.<precision>.per_output.<output>]: max_abs and/or max_rel for one output."""
    from ..runtime.contract import OUTPUT_NAMES

    if "per_output" not in table:
        return
    per_output = table["per_output"]
    if not isinstance(per_output, dict):
        raise ConfigError(f"{path} [{where}] per_output must be a table of outputs, got {per_output!r}: fix the file")
    for name, own in per_output.items():
        if name not in OUTPUT_NAMES or not isinstance(own, dict):
            raise ConfigError(f"{path} [{where}.per_output.{name}] is not an output: use one of {', '.join(OUTPUT_NAMES)}")
        for key in PER_OUTPUT_TOLERANCES:
            _check(path, f"{where}.per_output.{name}", own, key, (_number, "a number"), required=False)
        unknown = sorted(set(own) - set(PER_OUTPUT_TOLERANCES))
        if unknown:
            raise ConfigError(f"{path} [{where}.per_output.{name}] {unknown[0]} is not a per-output tolerance: "
                              "use max_abs or max_rel")


def check_tolerances_for(path: Path, tables: dict, precision: str) -> None:
    if precision not in tables.get("verify", {}).get("tolerances", {}):
        raise ConfigError(f"{path} has no [verify.tolerances.{precision}] table: add one to verify {precision} builds")




def check_variables(given: dict, known: tuple) -> None:
    """doit takes any NAME=VALUE; a misspelt one would be ignored and another variant built."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"unknown variable {unknown[0]}={given[unknown[0]]}: use {', '.join(known)}")
