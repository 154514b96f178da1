"""The schema of pipeline.toml, checked when doit loads, before any stage runs: every key known, typed and in
range, or one line naming the file, the table, the key and the fix (an unknown key with the closest known one),
not an "unexpected ...Error" minutes into a build, nor a misspelt key silently left at its default. Numbers
must be finite: NaN would fail every gate, and an infinite tolerance turns its gate off. Imports no torch.
(cases.toml is checked by `cases.check_cases`, with `read_toml` and `check_known` from here.)

Hand-written rather than pydantic or msgspec: each check is one row (key, predicate, what the value must be),
the message names the file, the table and the fix in one line, and the doit side stays free of a compiled
dependency it would load on every `doit list`. A library would save the predicates and cost the messages.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from pathlib import Path

from ..errors import ConfigError
from ..runtime.contract import OUTPUT_NAMES
from .precision import PRECISIONS


def read_toml(path: Path, what: str, fix: str) -> dict:
    """A TOML file's tables, or one line: missing, a folder, unreadable, not UTF-8, not TOML."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found: {fix}") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file: {fix}") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror}): {fix}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start}): {fix}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML ({e}): {fix}") from None


def check_known(path: Path, where: str, key: str, known) -> None:
    """An unknown key is an error, with the closest known key suggested."""
    if key in known:
        return
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean `{close[0]}`?" if close else f"known here: {', '.join(map(str, known))}"
    raise ConfigError(f"{path} {where}: unknown key `{key}`: {hint}")


def _int(low: int, high: int):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high,
            f"an integer from {low} to {high}")


def _number(low: float = 0.0, high: float = math.inf, above: bool = False):
    def check(v) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (v > low if above else v >= low) and v <= high
    bound = f"> {low:g}" if above else f">= {low:g}"
    return check, f"a finite number {bound}" + (f" and <= {high:g}" if math.isfinite(high) else "")


def _choice(*values):
    return (lambda v: v in values), " or ".join(f'"{v}"' for v in values)


def _flag():
    return (lambda v: isinstance(v, bool)), "true or false"


def _pair(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_int(1, 1024)[0](x) for x in v)


def _pairs():
    return ((lambda v: isinstance(v, list) and bool(v) and all(_pair(p) for p in v)),
            "a list of [batch, prompts] pairs of integers from 1 to 1024, e.g. [[1, 1], [2, 3]]")


def _distinct(choices, what: str, empty: bool = False):
    return ((lambda v: isinstance(v, list) and (empty or bool(v)) and len(set(v)) == len(v)
             and all(c in choices for c in v)),
            f"a list of distinct {what} from {', '.join(map(repr, choices))}")


def _per_precision(value):
    """A table of precision = value (each precision at most once; TOML refuses a key twice)."""
    check, what = value
    return ((lambda v: isinstance(v, dict) and all(k in PRECISIONS and check(x) for k, x in v.items())),
            f"a table of precision = value, each precision one of {', '.join(map(repr, PRECISIONS))} and each "
            f"value {what}")


def _inductor():
    """torch._inductor.config keys and plain values (`compile` checks the names against torch itself)."""
    plain = (bool, int, float, str)
    return ((lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, plain)
                                                  and not (isinstance(x, float) and not math.isfinite(x))
                                                  for k, x in v.items())),
            "a table of torch._inductor.config keys with plain values")


def _public_keys():
    def check(v) -> bool:
        from ..cache.signing import PublicKey

        try:
            return isinstance(v, list) and all(isinstance(k, str) and PublicKey.parse(k) for k in v)
        except ConfigError:
            return False
    return check, "a list of NAME:BASE64 ed25519 public keys (`sam3-aoti cache keygen NAME` prints one)"


UNIT = _number(0.0, 1.0)
TOLERANCE = _number(0.0)
# [bench] columns: each name and its label in bench.md (bench.py reads the labels from here)
BENCH_COLUMNS = {"meta": "Meta sam3 eager (bf16 autocast)", "transformers": "transformers eager",
                 "exported": "exported program", "aoti": "AOTI", "aoti_graphs": "AOTI + CUDA graphs",
                 "aoti_graphs_whole": "AOTI + CUDA graphs, the whole compiled model"}
ARCHITECTURES = ("tiny", "full")
PARITY_PRECISIONS = tuple(PRECISIONS)  # fp8 too: against Meta under bf16 autocast, at limits of its own

# A table's keys: name -> (check, what the value must be, required). "*": one child table per name of the set.
REQUIRED, OPTIONAL = True, False
# What `[export] optimizations` may name, in the order `model.optimizations` applies them (its registry; a test
# holds the two equal): each computes what transformers does, faster (vit_gelu_epilogue: with cuBLASLt's tanh GELU
# in a 16-bit CUDA build)
OPTIMIZATIONS = ("box_bias_kernel", "relu_epilogue", "attention_kernel", "vit_attention_kernel", "vit_gelu_epilogue",
                 "vit_rope_tables", "vit_patch_linear", "vit_fused_qkv", "vit_window_order", "vit_qkv_rope",
                 "grid_bias_attention",
                 "decoder_shared_projections", "pixel_decoder_per_image", "text_fused_qkv", "group_norm_by_channel")
PER_OUTPUT = {"max_abs": (*TOLERANCE, OPTIONAL), "max_rel": (*TOLERANCE, OPTIONAL)}
VERIFY_TOLERANCES = {
    "max_abs": (*TOLERANCE, REQUIRED), "max_rel": (*TOLERANCE, OPTIONAL), "pearson_min": (*UNIT, REQUIRED),
    "top1_score_abs": (*TOLERANCE, REQUIRED), "top5_overlap_min": (*UNIT, REQUIRED), "box_abs": (*TOLERANCE, REQUIRED),
    "mask_iou_min": (*UNIT, REQUIRED), "mask_band": (*TOLERANCE, OPTIONAL),
    "per_output": ({"*": (OUTPUT_NAMES, PER_OUTPUT)}, OPTIONAL),
}
PARITY_TOLERANCES = {
    "top1_same_min": (*UNIT, REQUIRED), "score_abs": (*TOLERANCE, REQUIRED), "box_abs": (*TOLERANCE, REQUIRED),
    "top5_overlap_min": (*UNIT, REQUIRED), "mask_iou_min": (*UNIT, REQUIRED),
    "pixels_max_levels": (*_number(0.0, 255.0), REQUIRED), "mask_band": (*TOLERANCE, OPTIONAL),
}
SCHEMA = {
    "profiles": ({"*": (("tiny", "sam3"), {
        "architecture": (*_choice(*ARCHITECTURES), REQUIRED),
        "precision": (*_choice(*PRECISIONS), OPTIONAL),
    })}, REQUIRED),
    "weights": ({
        "seed": (*_int(0, 2**32 - 1), REQUIRED),
        "random_init": ({"*": (ARCHITECTURES, {
            "bias_noise": (*_number(0.0, 10.0), REQUIRED),
            "matrix_gain": (*_number(0.0, 100.0, above=True), OPTIONAL),
        })}, REQUIRED),
    }, REQUIRED),
    "export": ({
        "example_batch": (*_int(2, 64), REQUIRED),  # >= 2: a size-1 example specializes the dim away
        "example_prompts": (*_int(2, 64), REQUIRED),
        "check_batch": (*_int(1, 64), REQUIRED),
        "check_prompts": (*_int(1, 64), REQUIRED),
        "transforms_example_size": ((lambda v: isinstance(v, list) and len(v) == 4 and v[1:2] == [3]
                                     and all(_int(2, 8192)[0](x) for x in v[:1] + v[2:])),
                                    "[batch, 3, height, width], each other size an integer from 2 to 8192", REQUIRED),
        "masked_attention": (*_choice("sdpa", "eager"), REQUIRED),
        "box_path_attention": (*_choice("fp32", "bf16"), REQUIRED),
        "box_path_linears": (*_choice("fp32", "bf16"), REQUIRED),
        "split": (*_distinct(("tiny", "sam3"), "profiles"), OPTIONAL),
        "optimizations": (*_distinct(OPTIMIZATIONS, "optimizations", empty=True), OPTIONAL),
        "precision_optimizations": (*_per_precision(_distinct(OPTIMIZATIONS, "optimizations", empty=True)), OPTIONAL),
    }, REQUIRED),
    "compile": ({
        "inductor": (*_inductor(), REQUIRED),
        "sdpa_backends": (*_distinct(("cudnn", "flash", "efficient", "math"), "SDPA kernels"), REQUIRED),
    }, REQUIRED),
    "tune": ({"enabled": (*_flag(), REQUIRED), "inductor": (*_inductor(), REQUIRED)}, REQUIRED),
    "verify": ({
        "shapes": (*_pairs(), REQUIRED),
        "largest_shape": ((lambda v: _pair(v)), "one [batch, prompts] pair of integers from 1 to 1024", REQUIRED),
        "tolerances": ({"*": (tuple(PRECISIONS), VERIFY_TOLERANCES)}, REQUIRED),
    }, REQUIRED),
    "bench": ({
        "shapes": (*_pairs(), REQUIRED),
        "warmup": (*_int(0, 10_000), REQUIRED),
        "iters": (*_int(1, 100_000), REQUIRED),
        "isa_probe_loaders": (*_flag(), REQUIRED),
        "columns": (*_distinct(tuple(BENCH_COLUMNS), "columns"), REQUIRED),
        "load_times": (*_flag(), REQUIRED),
        "sections": (*_choice("compiled", "eager", "off"), OPTIONAL),
    }, REQUIRED),
    "throughput": ({
        "images": (*_int(1, 1_000_000), REQUIRED),
        "min_side": (*_int(2, 10_000), REQUIRED),
        "large_width": (*_int(2, 20_000), REQUIRED),
        "broken": (*_int(0, 1_000_000), REQUIRED),
        "copies": (*_int(1, 1000), OPTIONAL),
        "prompt": ((lambda v: isinstance(v, str) and v.strip() != ""), "a noun phrase", REQUIRED),
        "batch_size": (*_int(1, 1024), REQUIRED),
        "actor_cpus": (*_int(1, 1024), OPTIONAL),
        "actors": ((lambda v: isinstance(v, list) and bool(v) and len(set(v)) == len(v)
                    and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 for n in v)),
                   "a list of distinct model actor counts, each from 1 to 1024", OPTIONAL),
    }, OPTIONAL),
    "parity": ({"tolerances": ({"*": (PARITY_PRECISIONS, PARITY_TOLERANCES)}, REQUIRED)}, REQUIRED),
    "render": ({
        "score_threshold": (*UNIT, REQUIRED),
        "max_instances": (*_int(1, 200), REQUIRED),
    }, REQUIRED),
    "cache": ({
        "url": ((lambda v: isinstance(v, str)), 'a folder, file://, s3:// or https:// URL, or "" for none', OPTIONAL),
        "trusted_keys": (*_public_keys(), OPTIONAL),
        "push": (*_distinct(("compile", "compile_parts", "package", "verify", "render"), "stages"), OPTIONAL),
    }, OPTIONAL),
}


def _walk(path: Path, where: str, table, schema: dict) -> None:
    """Check `table` (the TOML table at `where`) against `schema`, recursively."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path} [{where}] must be a table, got {table!r}: restore it from the repository's "
                          "pipeline.toml")
    if "*" in schema:  # one child table per name of a fixed set
        names, child = schema["*"]
        for name in table:
            check_known(path, f"[{where}]", name, names)
        for name, value in table.items():
            _walk(path, f"{where}.{name}", value, child)
        return
    for key in table:
        check_known(path, f"[{where}]" if where else "at the top level", key, schema)
    for key, spec in schema.items():
        label = f"{where}.{key}" if where else key
        required = spec[-1]
        if key not in table:
            if required and isinstance(spec[0], dict):
                raise ConfigError(f"{path} has no [{label}] table: restore it from the repository's pipeline.toml")
            if required:
                raise ConfigError(f"{path} [{where}] has no `{key}`: add it ({spec[1]})")
            continue
        if isinstance(spec[0], dict):
            _walk(path, label, table[key], spec[0])
        elif not spec[0](table[key]):
            raise ConfigError(f"{path} [{where}] {key} must be {spec[1]}, got {table[key]!r}: fix the file")


def check_pipeline(path: Path, tables: dict, profiles: tuple, precisions: tuple) -> None:
    """Every key of pipeline.toml: known, of the right type, finite and in range; every profile present."""
    _walk(path, "", tables, SCHEMA)
    for name in profiles:
        if name not in tables["profiles"]:
            raise ConfigError(f"{path} has no [profiles.{name}] table: restore it from the repository's pipeline.toml")
    for precision in PARITY_PRECISIONS:
        if precision not in tables["parity"]["tolerances"]:
            raise ConfigError(f"{path} has no [parity.tolerances.{precision}] table: restore it from the "
                              "repository's pipeline.toml")


def check_tolerances_for(path: Path, tables: dict, precision: str) -> None:
    if precision not in tables.get("verify", {}).get("tolerances", {}):
        raise ConfigError(f"{path} has no [verify.tolerances.{precision}] table: add one to verify {precision} builds")


def check_variables(given: dict, known: tuple) -> None:
    """doit takes any NAME=VALUE; a misspelt one would be ignored and another variant built."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown variable {unknown[0]}={given[unknown[0]]}{hint}: use {', '.join(known)}")
