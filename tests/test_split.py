"""Encode once, decode many: the model in parts (`[export] split`), equal to the whole, weights stored once."""

import json
import zipfile

import pytest
import torch

from sam3_aoti.errors import InputError, PackageError
from sam3_aoti.model.configs import example_inputs
from sam3_aoti.model.exporting import example_boxes
from sam3_aoti.model.grounding import DECODE_IMAGE_INPUTS, PARTS, Part, Sam3Grounding
from sam3_aoti.runtime.archive import PART_NAMES, SHARED_WEIGHT_PARTS
from sam3_aoti.runtime.loader import load_package

from helpers import TINY, copy_repo, rewrite_package, run_doit


@pytest.fixture(scope="module")
def package(package_path):
    return load_package(package_path)


def close(got, want, atol=1e-4):
    return all(g.shape == w.shape and float((g - w).abs().max()) <= atol for g, w in zip(got, want, strict=True))


def test_the_whole_model_is_decode_of_the_two_encoders(tiny_model):
    wrapper = Sam3Grounding(tiny_model).eval()
    images, token_ids = example_inputs(tiny_model.config, 2, 3)
    with torch.no_grad():
        whole = wrapper(images, token_ids)
        parts = wrapper.decode(*wrapper.encode_image(images)[:DECODE_IMAGE_INPUTS], *wrapper.encode_text(token_ids))
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))


def test_the_parts_hold_the_models_tensors_once_under_their_names(tiny_model):
    """Each part's tensors are the model's own (same objects, same names); together they are all of them, and
    only the DETR encoder's first layer (encode_image runs its self-attention, decode the rest) and the geometry
    encoder (encode_image runs it on no box, encode_boxes on boxes) are in two parts."""
    wrapper = Sam3Grounding(tiny_model).eval()
    everything = dict(wrapper.named_parameters()) | dict(wrapper.named_buffers())
    seen = []
    for name in PART_NAMES:
        part = Part(wrapper, name)
        tensors = dict(part.named_parameters()) | dict(part.named_buffers())
        assert all(everything[k] is v for k, v in tensors.items())
        seen += list(tensors)
    twice = {k for k in seen if seen.count(k) > 1}
    assert set(seen) == set(everything) and tuple(PARTS) == PART_NAMES
    assert twice and all(k.startswith(("model.detr_encoder.layers.0.", "model.geometry_encoder.")) for k in twice)


def test_a_split_package_decodes_what_model_gives(package):
    assert package.parts == PART_NAMES and package.backends["decode"] == "aoti"
    images, token_ids = tiny_inputs(package, 3, 4)
    with torch.no_grad():
        whole = package.model(images, token_ids)
        split = package.decode(package.encode_image(images), package.encode_text(token_ids))
    assert close(split, whole)


def test_the_split_call_is_the_parts_one_by_one(package_path, package, monkeypatch):
    """With `split_call` on (the argument or the environment), `model` and `model_with_boxes` are one call of the
    parts (on a GPU the text encoder beside the image encoder) and give exactly what the parts give one by one;
    off (a CPU package's default, or SAM3_AOTI_SPLIT_CALL=0 on a GPU) `model` is the whole compiled model. Inputs
    are checked as `model`'s."""
    from sam3_aoti.runtime.split_call import split_call_wanted

    assert split_call_wanted(None, "cuda") and not split_call_wanted(None, "cpu")
    monkeypatch.setenv("SAM3_AOTI_SPLIT_CALL", "0")
    assert not split_call_wanted(None, "cuda") and split_call_wanted(True, "cpu")
    monkeypatch.setenv("SAM3_AOTI_SPLIT_CALL", "1")
    on, off = load_package(package_path), load_package(package_path, split_call=False)
    assert on.split_call and not off.split_call and not package.split_call
    assert on.model is on["model_from_parts"] and off.model is off["model"]
    images, token_ids = tiny_inputs(package, 2, 3)
    boxes, labels = example_boxes(2, 3, seed=5)
    with torch.no_grad():
        features, text = package.encode_image(images), package.encode_text(token_ids)
        one_by_one = package.decode(features, text)
        boxed_one_by_one = package.decode(features, text, package.encode_boxes(features, boxes, labels))
        call, boxed = on.model(images, token_ids), on.model_with_boxes(images, token_ids, boxes, labels)
    assert all(torch.equal(a, b) for a, b in zip(call, one_by_one, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(boxed, boxed_one_by_one, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(package.model_with_boxes(images, token_ids, boxes, labels),
                                                 boxed_one_by_one, strict=True))
    with pytest.raises(InputError, match="boxes"):
        on.model_with_boxes(images, token_ids, boxes[:1], labels[:1])
    with pytest.raises(InputError, match="token_ids"):
        on.model(images, token_ids.float())


def tiny_inputs(package, batch, prompts, seed=7):
    side = package.metadata["models"]["model"]["inputs"]["images"]["shape"][2]
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, side, side, generator=g)
    phrases = ["a dog", "a red car", "the tree", "a roof", "two boats", "a road"]
    return images, package.encode_prompts([phrases[i % len(phrases)] for i in range(prompts)])


def test_prompts_in_chunks_and_kept_class_features_give_models_outputs(package):
    """An image encoded once; prompts encoded in chunks (a fixed class list's features kept and reused)."""
    images, token_ids = tiny_inputs(package, 2, 5)
    with torch.no_grad():
        whole = package.model(images, token_ids)
        features = package.encode_image(images)
        texts = [package.encode_text(token_ids[i:i + 2]) for i in range(0, 5, 2)]
        assert close(package.decode_chunked(features, texts), whole)
        one_image = package.encode_image(images[1:])  # the class list's features again, another batch
        second = package.decode_chunked(one_image, texts)
    assert close(second, tuple(o.unflatten(0, (2, 5))[1] for o in whole))


def test_split_inputs_that_do_not_fit_are_one_line_errors(package):
    images, token_ids = tiny_inputs(package, 2, 3)
    features, text = package.encode_image(images), package.encode_text(token_ids)
    with pytest.raises(InputError, match="decode takes 8 tensors, got 6"):
        package.decode(features[:4], text)
    with pytest.raises(InputError, match="input 6 must be float32"):
        package.decode(features, (text[0].double(), text[1]))
    other = package.encode_image(images[:1])
    with pytest.raises(InputError, match="has batch 1, an earlier one 2"):
        package.decode((*features[:4], *other[4:]), text)
    with pytest.raises(InputError, match="images must be float32"):
        package.encode_image(images.double())
    with pytest.raises(InputError, match="token_ids must be int64"):
        package.encode_text(token_ids.int())


def test_the_weights_are_stored_once_and_read_by_the_parts_in_place(package_path, package):
    with zipfile.ZipFile(package_path) as archive:
        blobs = [i.filename.split("/")[3] for i in archive.infolist() if i.filename.endswith("_weights.blob")]  # by model
        metadata = json.loads(archive.read(next(n for n in archive.namelist() if n.endswith("extra/metadata.json"))))
    assert sorted(blobs) == ["encode_boxes", "model"]  # the box encoder's layers: no other model reads them
    assert all(metadata["models"][n]["weights_from"] == "model" for n in SHARED_WEIGHT_PARTS)
    assert "weights_from" not in metadata["models"]["encode_boxes"]
    runner = lambda name: package.runners[name].runner.runner  # CheckedPart -> AotiRunner -> torch's runner
    model = {k: v.data_ptr() for k, v in runner("model").extract_constants_map(False).items()}
    for name in SHARED_WEIGHT_PARTS:
        constants = runner(name).extract_constants_map(False)
        assert constants and all(model[k] == v.data_ptr() for k, v in constants.items())


def test_the_fallback_stores_each_tensor_once(package_path, package):
    """The exported archive (the fallback) writes model's tensors once: the parts' configs name model's files,
    and no two tensor files hold the same bytes (torch's `package_pt2` wrote them again for every program)."""
    from sam3_aoti.aoti.weights_blob import tensor_entries
    from sam3_aoti.runtime.archive import fallback_of
    from sam3_aoti.model.exporting import TENSOR_FILES

    with zipfile.ZipFile(fallback_of(package_path)) as archive:
        entries = {name: tensor_entries(archive, name) for name in ("model", *PART_NAMES)}
        files = [i for i in archive.infolist() if i.filename.split("/", 1)[1].startswith(TENSOR_FILES)]
        contents = [archive.read(i) for i in files]
    for name in PART_NAMES:  # a tensor model holds too is model's file (encode_boxes has some of its own)
        assert entries[name] and all(entries["model"].get(fqn, entry) == entry for fqn, entry in entries[name].items())
        assert name == "encode_boxes" or set(entries[name]) <= set(entries["model"])
    assert len(set(contents)) == len(contents)
    assert {e for table in entries.values() for e in table.values()} == {i.filename for i in files}


def test_graphs_are_skipped_without_cuda_and_the_fallback_has_the_parts(package):
    assert package.cuda_graphs.startswith("off") and package.graph_runner is None
    fallback = package.exported_only()
    assert fallback.parts == PART_NAMES and fallback.backends["decode"] == "exported"
    images, token_ids = tiny_inputs(package, 1, 2)
    with torch.no_grad():
        assert close(fallback.decode(fallback.encode_image(images), fallback.encode_text(token_ids)),
                     package.model(images, token_ids))


def test_a_package_with_some_parts_only_is_refused(package_path, tmp_path):
    def drop_decode(name, data):
        return None if "/data/aotinductor/decode/" in name else data

    broken = rewrite_package(package_path, tmp_path / "sam3.pt2", drop_decode)
    with pytest.raises(PackageError, match="all or none of encode_image, encode_text, encode_boxes, decode"):
        from sam3_aoti.runtime.loader import load_aoti_runners

        load_aoti_runners(broken)


def test_a_package_without_parts_says_how_to_get_them(package, monkeypatch):
    whole_only = type(package)({k: v for k, v in package.runners.items() if k not in PART_NAMES},
                               package.backends, package.metadata, package.merges_text, package.path)
    with pytest.raises(InputError, match=r"has no encode_image .*add its profile \(tiny\) to `\[export\] split`"):
        whole_only.encode_image(torch.zeros(1, 3, 2, 2))


def test_verify_gates_the_split_path_and_info_lists_the_parts(built_repo):
    report = json.loads((built_repo / TINY / "verify" / "report.json").read_text())
    backends = {row["backend"] for row in report["rows"]}
    assert {"aoti split", "aoti chunks", "exported split", "exported chunks"} <= backends
    assert all(row["ok"] for row in report["rows"])
    import subprocess
    import sys

    info = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(built_repo / TINY / "package" / "sam3.pt2")],
                          capture_output=True, text=True, check=True).stdout
    for name in PART_NAMES:
        assert f"{name}: backends aoti" in info and "reads model's weights" in info
    assert "input  geometry_prompt" in info and "output text_features" in info


def test_compiles_at_once_fit_the_cores_and_the_memory():
    from sam3_aoti.aoti.workers import compile_workers

    assert compile_workers(5, 2 << 30, "cuda", cores=16, memory=128 << 30) == 4  # the H200: a quarter of its cores
    assert compile_workers(5, 8 << 30, "cuda", cores=16, memory=64 << 30) == 2  # big weights: a third of the memory
    assert compile_workers(5, 2 << 30, "cuda", cores=2, memory=24 << 30) == 1  # a small GPU box: one at a time
    assert compile_workers(6, 20 << 20, "cpu", cores=2, memory=24 << 30) == 2  # CI's machine, tiny: one a core
    assert compile_workers(2, 1, "cuda", cores=64, memory=1 << 40) == 2  # never more than the models
    assert compile_workers(5, 64 << 30, "cpu", cores=16, memory=16 << 30) == 1  # at least one


def test_a_profile_left_out_of_split_builds_no_parts(built_repo, tmp_path):
    """A profile `[export] split` does not name gets model and transforms alone: the parts' stages are off (a line
    says why), and neither the package's task nor its stage reads their files."""
    from sam3_aoti.pipeline.package_metadata import exported_signatures
    from sam3_aoti.pipeline.paths import ProfilePaths
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.stages.package import compiled_programs

    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    paths = ProfilePaths.of(settings)
    index, archives, folders = compiled_programs(paths, split=False)
    assert list(index["models"]) == ["model", "transforms"] and set(archives.values()) == {paths.exported}
    assert set(exported_signatures(paths, split=False)["programs"]) == {"model", "transforms"}
    whole, archives, folders = compiled_programs(paths, split=True)  # the build's own: both compiles as one
    assert list(whole["models"]) == ["model", *PART_NAMES, "transforms"]
    assert {archives[n] for n in PART_NAMES} == {paths.exported_parts} and folders["decode"] == paths.compiled_parts
    assert "export/parts.pt2" in run_doit(built_repo, "info", "package", "device=cpu").stdout

    repo = copy_repo(tmp_path)
    config = repo / "pipeline.toml"
    config.write_text(config.read_text().replace('split = ["tiny", "sam3"]', 'split = ["sam3"]', 1))
    proc = run_doit(repo, "export_parts", "compile_parts", "device=cpu")
    assert proc.stdout.count("is off (profile=tiny is not in [export] split)") == 2, proc.stdout
    inputs = run_doit(repo, "info", "package", "device=cpu", check=False).stdout  # exit 1: not built, so not up to date
    assert "export/programs.pt2" in inputs and "parts" not in inputs
