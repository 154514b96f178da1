"""The archive stands alone: torch is all a service needs; `sam3-aoti predict` runs it on a user's image."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
from PIL import Image

from sam3_aoti.runtime.loader import load_package
from sam3_aoti.runtime.tokenizer import ClipTokenizer, encode_prompts

from helpers import REPO

# Any import of these fails in the consumer's process, as if they were not installed.
BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = {"transformers", "doit", "sam3_aoti", "regex", "open_clip", "skimage", "huggingface_hub"}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not installed here")

    sys.meta_path.insert(0, Blocker())
""")

CONSUMER = BLOCKER + textwrap.dedent("""
    import json, zipfile
    import torch
    from torch._inductor.package import load_package

    path, inputs_path, out_path = sys.argv[1:]
    with zipfile.ZipFile(path) as archive:
        metadata = json.loads(next(archive.read(n) for n in archive.namelist() if n.endswith("/extra/metadata.json")))
    transforms, model = load_package(path, "transforms"), load_package(path, "model")
    images, token_ids = torch.load(inputs_path)
    outputs = model(transforms(images), token_ids)
    torch.save({"names": metadata["models"]["model"]["output_order"], "outputs": [o for o in outputs],
                "modules": sorted(m.split(".")[0] for m in sys.modules)}, out_path)
""")


def clean_env() -> dict:
    """No PYTHONPATH: this repo's sources are not importable either."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_torch_only_consumer_runs_transforms_then_model(package_path, tmp_path):
    images = torch.rand(2, 3, 90, 120) * 255
    token_ids = encode_prompts(["a person", "a rocket", "a cup of coffee"])
    torch.save((images, token_ids), tmp_path / "inputs.pt")
    (tmp_path / "consumer.py").write_text(CONSUMER)
    proc = subprocess.run([sys.executable, "consumer.py", str(package_path), "inputs.pt", "out.pt"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert not {"transformers", "sam3_aoti", "doit"} & set(result["modules"])
    assert result["names"] == ["pred_logits", "pred_boxes", "pred_masks", "presence_logit_dec"]
    package = load_package(package_path)
    with torch.no_grad():
        ours = package.model(package.transforms(images), token_ids)
    for theirs, mine in zip(result["outputs"], ours):
        assert torch.equal(theirs, mine)


def test_encode_prompts_needs_only_the_archive_and_torch(package_path, tmp_path):
    script = BLOCKER.replace('"sam3_aoti", ', "") + textwrap.dedent("""
        from sam3_aoti import load_package
        print(load_package(sys.argv[1]).encode_prompts(["a truck", "Solar-panels, 2 roofs!"]).tolist())
    """)
    (tmp_path / "encode.py").write_text(script)
    env = {**clean_env(), "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "encode.py", str(package_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ClipTokenizer.bundled()(["a truck", "Solar-panels, 2 roofs!"])


def predict(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "sam3_aoti", "predict", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_predict_writes_an_overlay_and_instances(package_path, tmp_path):
    Image.fromarray((np.random.default_rng(0).random((75, 130, 3)) * 255).astype(np.uint8)).save(tmp_path / "roof.jpg")
    proc = predict(str(package_path), "--image", "roof.jpg", "--prompt", "a roof", "--prompt", "a car",
                   "--threshold", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "roof_sam3.json").read_text())
    queries = load_package(package_path).metadata["models"]["model"]["outputs"]["pred_logits"]["shape"][1]
    assert len(result["instances"]) == 2 * queries  # threshold 0 keeps every query of both prompts
    assert {i["prompt"] for i in result["instances"]} == {"a roof", "a car"}
    scores = [i["score"] for i in result["instances"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert Image.open(tmp_path / "roof_sam3.png").size == (130, 75)

    proc = predict(str(package_path), "--image", "roof.jpg", "--prompt", "a roof", "--threshold", "1",
                   "--output", "out/none", cwd=tmp_path)
    assert proc.returncode == 0 and json.loads((tmp_path / "out" / "none.json").read_text())["instances"] == []


def test_predict_bad_input_is_one_line(package_path, tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    for args, words in [(["--image", "missing.png"], "no image at"), (["--image", "notes.txt"], "cannot read")]:
        proc = predict(str(package_path), *args, "--prompt", "a car", cwd=tmp_path)
        assert proc.returncode != 0 and words in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def info(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "sam3_aoti", "info", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_info_says_what_the_package_holds(package_path, tmp_path):
    import hashlib
    import zipfile

    proc = info(str(package_path), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    model = data["models"]["model"]
    assert model["backends"] == ["aoti", "exported (fallback)"] and model["device"] == "cpu"
    assert model["inputs"]["token_ids"] == {"shape": ["num_prompts", 32], "dtype": "int64"}
    assert model["outputs"]["pred_masks"]["dtype"] == "float32"
    assert model["dynamic_dims"] == {"batch": {"min": 1}, "num_prompts": {"min": 1}}
    assert data["precision"] == "fp32" and data["versions"]["torch"] == torch.__version__
    assert data["bytes"] == package_path.stat().st_size and data["fallback"]["bytes"] > 0
    with zipfile.ZipFile(package_path) as archive:
        blob = next(n for n in archive.namelist() if "/aotinductor/model/" in n and n.endswith("_weights.blob"))
        assert data["weights_sha256"]["model"] == hashlib.sha256(archive.read(blob)).hexdigest()
        assert model["weights_bytes"] == archive.getinfo(blob).file_size and model["code_bytes"] > 0
    text = info(str(package_path), cwd=tmp_path).stdout
    assert "pred_masks" in text and "batch >= 1" in text and "backends aoti, exported (fallback)" in text


def test_info_on_a_bad_file_is_one_line_and_exit_2(package_path, tmp_path):
    import zipfile

    (tmp_path / "truncated.pt2").write_bytes(package_path.read_bytes()[:100_000])
    (tmp_path / "notes.pt2").write_text("not a package")
    with zipfile.ZipFile(tmp_path / "other.pt2", "w") as archive:
        archive.writestr("other/readme.txt", "a zip, not a PT2 archive")
    for name, words in [("missing.pt2", "no package at"), ("truncated.pt2", "truncated or not a sam3-aoti package"),
                        ("notes.pt2", "truncated or not a sam3-aoti package"),
                        ("other.pt2", "holds the entry 'other/readme.txt', which no sam3-aoti package has")]:
        proc = info(name, cwd=tmp_path)
        assert proc.returncode == 2 and words in proc.stderr, (name, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout, (name, proc.stderr)


def test_predict_does_not_import_transformers_and_the_contract_not_torch(package_path, tmp_path):
    """`predict` is torch + the archive (transformers is a 20 s cold import); the contract imports no torch."""
    Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(tmp_path / "dark.png")
    probe = ("import sys; from sam3_aoti.cli import main; import sam3_aoti.runtime.contract; "
             f"main(['predict', {str(package_path)!r}, '--image', 'dark.png', '--prompt', 'a car']); "
             "print(sorted(m for m in ('transformers', 'doit', 'sam3_aoti.model', 'sam3_aoti.pipeline', 'sam3_aoti.stages') "
             "if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    proc = subprocess.run([sys.executable, "-c", "import sys, sam3_aoti.runtime.contract; print('torch' in sys.modules)"],
                          env=env, capture_output=True, text=True)
    assert proc.stdout.strip() == "False"


EXPORTED_FALLBACK = BLOCKER.replace('"sam3_aoti", ', "") + textwrap.dedent("""
    import torch
    from sam3_aoti.runtime.loader import load_package

    path, inputs_path, out_path = sys.argv[1:]
    package = load_package(path, prefer_aoti=False)
    images, token_ids = torch.load(inputs_path)
    with torch.no_grad():
        outputs = package.model(package.transforms(images), token_ids)
    torch.save({"backends": package.backends, "outputs": list(outputs),
                "modules": sorted(m for m in sys.modules if m.startswith(("sam3_aoti", "transformers")))}, out_path)
""")


def test_the_runtimes_exported_fallback_runs_the_projects_ops_without_the_build(package_path, tmp_path):
    """The exported programs call `sam3_aoti::box_bias_mlp` and `sam3_aoti::attention` by name (`[export]
    optimizations`): the runtime registers them itself, so its fallback deserializes and runs them with no
    transformers and none of the build's modules, and gives what the AOTI models give."""
    images = torch.rand(1, 3, 90, 120) * 255
    token_ids = encode_prompts(["a person", "a rocket"])
    torch.save((images, token_ids), tmp_path / "inputs.pt")
    (tmp_path / "fallback.py").write_text(EXPORTED_FALLBACK)
    env = {**clean_env(), "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "fallback.py", str(package_path), "inputs.pt", "out.pt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert set(result["backends"].values()) == {"exported"}
    assert {"sam3_aoti.runtime.box_bias", "sam3_aoti.runtime.attention"} <= set(result["modules"])
    assert not [m for m in result["modules"] if m.startswith(("transformers", "sam3_aoti.model", "sam3_aoti.pipeline"))]
    package = load_package(package_path)
    with torch.no_grad():
        ours = package.model(package.transforms(images), token_ids)
    for theirs, mine in zip(result["outputs"], ours):
        torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=1e-4)


TORCH_ONLY = textwrap.dedent("""
    import importlib.util, sys
    import torch
    from torch.export.pt2_archive._package import load_pt2

    assert importlib.util.find_spec("sam3_aoti") is None  # the project is not here; torch is
    path, inputs_path, out_path = sys.argv[1:]
    programs = load_pt2(path).exported_programs  # the production loader's second choice, by hand
    images, token_ids = torch.load(inputs_path)
    with torch.no_grad():
        outputs = programs["model"].module()(programs["transforms"].module()(images), token_ids)
    torch.save({"programs": sorted(programs), "outputs": [o.clone() for o in outputs]}, out_path)
""")


def test_the_exported_fallback_loads_where_torch_alone_is_installed(package_path, tmp_path):
    """A venv with torch and nothing of this project (torch's site-packages on its path, not processed, so the
    project's editable install is not there): torch's own `load_pt2` reads `sam3.exported.pt2` and its model
    runs, giving what the package gives. The export stage's own programs (the project's custom ops in them, what
    the AOTI compile reads) do not load there: what the fallback was before."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "torch_only.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = tmp_path / "venv" / "bin" / "python"
    images, token_ids = torch.rand(1, 3, 90, 120) * 255, encode_prompts(["a person", "a rocket"])
    torch.save((images, token_ids), tmp_path / "inputs.pt")
    (tmp_path / "torch_only.py").write_text(TORCH_ONLY)
    env = clean_env()
    fallback = package_path.with_name("sam3.exported.pt2")
    proc = subprocess.run([str(python), "torch_only.py", str(fallback), "inputs.pt", "out.pt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert {"model", "transforms", "decode"} <= set(result["programs"])
    package = load_package(package_path)
    with torch.no_grad():
        ours = package.model(package.transforms(images), token_ids)
    for theirs, mine in zip(result["outputs"], ours):
        torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=1e-4)
    with_custom_ops = package_path.parent.parent / "export" / "programs.pt2"
    proc = subprocess.run([str(python), "torch_only.py", str(with_custom_ops), "inputs.pt", "out.pt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "sam3_aoti" in proc.stderr
