"""sam3-aoti: `uv run doit` builds, verifies and renders the SAM3 AOTInductor package.

Variables (doit style): profile=tiny|sam3 device=cpu|cuda precision=fp32|bf16|fp8 weights=random|PATH config=PATH
                       toolkit=pinned|machine (the CUDA toolkit: the pip wheels uv.lock pins, or the machine's)
                       cache=URL (a signed binary cache: substitutes from it; pushes with SAM3_AOTI_SIGNING_KEY) ref=NAME
Each variant (profile, precision, device) builds in its own folder: artifacts/<profile>-<precision>-<device>/.
"""

import os
import shutil

from tasks import ENV_FILE, PATHS, SETTINGS, SummaryReporter, check_artifacts, off, relative, stage_task, weights_inputs
from tasks.cache import push_built
from tasks.runs import RecordedChecksums, guard
from sam3_aoti.pipeline.paths import DEFAULT_CASES, PIN_TABLE, ToolchainPaths
from sam3_aoti.pipeline.settings import compared_shapes, gpu_model, package_version
from sam3_aoti.runtime.integrity import digest_file
from sam3_aoti.toolchain.cuda_toolkit import machine_toolkit_matters

DOIT_CONFIG = {
    "default_tasks": ["toolchain", "render"],
    "dep_file": str(PATHS.root / ".doit.json"),  # one state file per variant: switching never rebuilds
    "backend": "json",  # saved after every task (tasks.runs): an interrupted run loses only its current task
    "reporter": SummaryReporter,
    "action_string_formatting": "new",
    "check_file_uptodate": RecordedChecksums,  # the manifest's sha256 where it has one (no second hash of GBs)
    # Every task that is ready at once, in threads (each stage is a process of its own): beside model's export and
    # compile, the build's longest path, the eager reference, the parts' export and compile, and the fallback and
    # its measurement, which step back for that path (tasks.runs.BESIDE).
    "num_process": 5,
    "par_type": "thread",
}
RecordedChecksums.manifest = PATHS.manifest
PROGRAM_DIGESTS = [PATHS.program_digest, *([PATHS.parts_digest] if SETTINGS.split else [])]  # every program's digest
guard(PATHS.root)  # one run per variant; leftovers of killed runs removed; doit's state saved per task


def task_toolchain():
    # The machine's CUDA_HOME and nvcc (absolute paths) matter only where its toolkit can be the one used.
    machine = ({"CUDA_HOME": os.environ.get("CUDA_HOME"), "nvcc": shutil.which("nvcc")}
               if machine_toolkit_matters(SETTINGS.toolkit, package_version("torch")) else {})
    return stage_task("toolchain", "CUDA toolkit and C++ compiler for AOTInductor, as facts in seconds (the probe runs before a compile)",
                      [PIN_TABLE], [ToolchainPaths.of(SETTINGS).doctor, ENV_FILE],
                      recorded=False,  # per machine, outside the variant's manifest
                      toolkit=SETTINGS.toolkit, machine={**machine, "CXX": os.environ.get("CXX")})


def task_weights():
    return stage_task("weights", "Write the profile's checkpoint (seeded random init, HF folder or Meta's sam3.pt)",
                      weights_inputs(SETTINGS.weights),
                      [*PATHS.checkpoint_files, PATHS.tokenizer_merges], weights=SETTINGS.weights)


def task_export():
    return stage_task("export", "torch.export model + transforms with dynamic batch/prompts; re-run at new shapes",
                      PATHS.checkpoint_files, [PATHS.exported, PATHS.program_digest])


def task_export_parts():
    # Beside model's compile, which so starts before the parts are traced.
    if not SETTINGS.split:
        return off("The model in parts", f"profile={SETTINGS.profile} is not in [export] split", "export_parts is off")
    return stage_task("export_parts", "torch.export the model's parts (encode_image, encode_text, encode_boxes, decode)",
                      PATHS.checkpoint_files, [PATHS.exported_parts, PATHS.parts_digest],
                      export=SETTINGS.stage("export"))


def task_fallback():
    # Beside compile (after export, so that model's export has the cores first); only package reads it.
    return stage_task("fallback", "The exported programs with the custom ops in torch ops: the fallback torch alone loads",
                      [PATHS.exported, *PATHS.checkpoint_files], [PATHS.exported_portable],
                      export=SETTINGS.stage("export"))


def task_fallback_drift():
    # Beside compile too: what verify would otherwise load and measure after the package.
    return stage_task("fallback_drift", "The fallback read back and measured against eager on verify's inputs",
                      [PATHS.exported_portable, *PROGRAM_DIGESTS, *PATHS.checkpoint_files, PATHS.tokenizer_merges,
                       PATHS.reference_index, DEFAULT_CASES], [PATHS.fallback_drift],
                      inputs=compared_shapes(SETTINGS))


def task_tune():
    # Once per GPU model, torch/Triton version and graph: the program digest and the GPU are its inputs.
    if not SETTINGS.tuned:
        why = "device=cpu" if SETTINGS.device != "cuda" else "[tune] enabled = false in pipeline.toml"
        return off("Inductor autotuning for compile", why, "tuning is off", "compile uses [compile] options only")
    return stage_task("tune", "Inductor autotuning (GEMM templates, kernel configs), kept for every later compile",
                      [*PROGRAM_DIGESTS, ENV_FILE], [PATHS.tuning_index],
                      gpu=gpu_model(), triton=package_version("triton"), compile=SETTINGS.stage("compile"))


def task_compile():
    # Keyed by the program digest (graphs, signatures, weight layouts), not the weights: a new seed or
    # checkpoint of the same architecture re-packages without running AOTInductor again. cuda.env (a
    # target of toolchain) names the toolkit and the versions that shape the compiled code; a tuned
    # compile also reads the tune stage's results.
    tuning = [PATHS.tuning_index] if SETTINGS.tuned else []
    return stage_task("compile", "AOTInductor-compile model and transforms into code without weights (the slow part)",
                      [PATHS.program_digest, ENV_FILE, *tuning], [PATHS.compiled_index],
                      tuned=SETTINGS.tuned, tune=SETTINGS.stage("tune") if SETTINGS.tuned else None)


def task_compile_parts():
    # Beside compile, as soon as the parts are exported; keyed the same way, by the parts' program digest.
    if not SETTINGS.split:
        return off("The model in parts", f"profile={SETTINGS.profile} is not in [export] split", "compile_parts is off")
    tuning = [PATHS.tuning_index] if SETTINGS.tuned else []
    return stage_task("compile_parts", "AOTInductor-compile the model's parts into code without weights",
                      [PATHS.parts_digest, ENV_FILE, *tuning], [PATHS.compiled_parts_index],
                      compile=SETTINGS.stage("compile"), tuned=SETTINGS.tuned,
                      tune=SETTINGS.stage("tune") if SETTINGS.tuned else None)


def task_package():
    return stage_task("package", "Compiled code + current weights (one copy) -> sam3.pt2; exported fallback beside it",
                      [PATHS.compiled_index, PATHS.exported, PATHS.exported_portable, PATHS.program_digest,
                       *([PATHS.compiled_parts_index, PATHS.exported_parts, PATHS.parts_digest] if SETTINGS.split else []),
                       PATHS.tokenizer_merges, *PATHS.checkpoint_files],
                      [PATHS.package, PATHS.fallback_package, *map(digest_file, [PATHS.package, PATHS.fallback_package])])


def task_reference():
    # Beside export and compile (it needs only the weights): the eager model's load and runs leave verify.
    return stage_task("reference", "Eager outputs on verify's inputs, computed while the package compiles",
                      [*PATHS.checkpoint_files, PATHS.tokenizer_merges, DEFAULT_CASES], [PATHS.reference_index],
                      inputs=compared_shapes(SETTINGS))


def task_verify():
    # The checkpoint too: eager, the reference, is built from it (a substituted package brings no weights).
    return stage_task("verify", "Gate the package: shape sweep and real photographs, AOTI vs eager",
                      [PATHS.package, PATHS.fallback_package, DEFAULT_CASES, *PATHS.checkpoint_files,
                       PATHS.reference_index, PATHS.fallback_drift],
                      [PATHS.verify_report_json, PATHS.verify_report_md, PATHS.verify_report_html])


def task_render():
    # After verify (a failed gate stops here), but verify's report is no input of the pictures.
    return {**stage_task("render", "Pictures: eager beside AOTI per case, top-mask differences, score scatter",
                         [PATHS.package, DEFAULT_CASES, *PATHS.checkpoint_files],
                         [PATHS.render_index]),
            "task_dep": ["verify"]}


def task_bench():
    return stage_task("bench", "Latency table and plot: Meta eager, transformers eager, exported, AOTI with/without CUDA graphs (not in the default run)",
                      [PATHS.package, PATHS.fallback_package], [PATHS.bench_json, PATHS.bench_md, PATHS.bench_plot])


def task_throughput():
    return stage_task("throughput", "sam3-aoti segment over a folder of photographs on Ray Data: images/s against bench's 16 x 1, GPU busy share (not in the default run)",
                      [PATHS.package], [PATHS.throughput_json, PATHS.throughput_md])


def task_parity():
    return stage_task("parity", "Package vs Meta's own SAM3 on the cases (GPU, profile=sam3, fp32 or bf16; needs the sam3 package)",
                      [PATHS.package, *PATHS.checkpoint_files, DEFAULT_CASES], [PATHS.parity_json, PATHS.parity_md])


def task_push():
    return {"doc": f"Push this variant's built stages and its verified package's refs to cache=URL (needs "
                   f"SAM3_AOTI_SIGNING_KEY) [{relative(PATHS.root)}/]",
            "actions": [push_built], "uptodate": [False], "verbosity": 2}


def task_check():
    return {"doc": f"Re-hash every artifact against the manifest and name what changed [{relative(PATHS.root)}/]",
            "actions": [check_artifacts], "uptodate": [False], "verbosity": 2}
