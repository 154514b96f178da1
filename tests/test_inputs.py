"""Bad input to the runtime and `predict` (tensors, prompts, images, output paths) is one line, before native code
runs; images are read as a viewer shows them."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from sam3_aoti.errors import InputError, PackageError
from sam3_aoti.runtime import images as image_reader
from sam3_aoti.runtime.loader import load_package

from helpers import REPO, predict


def test_model_and_transforms_refuse_inputs_they_cannot_take(package_path):
    package = load_package(package_path)
    ids = package.encode_prompts(["a cat"])
    good = torch.rand(1, 3, 112, 112)
    for images, token_ids, words in [
        (good.double(), ids, "images must be float32 [batch, 3, 112, 112] on cpu, got float64"),
        (good[0], ids, "got float32 [3, 112, 112]"),
        (torch.rand(1, 3, 100, 112), ids, "got float32 [1, 3, 100, 112]"),
        (torch.rand(0, 3, 112, 112), ids, "batch 0"),
        (good, ids[:, :31], "token_ids must be int64 [num_prompts, 32]"),
        (good, ids.int(), "token_ids must be int64"),
        (good, ids[:0], "num_prompts 0"),
        (good, ids + 60000, "ids outside [0, 49408)"),
    ]:
        with pytest.raises(InputError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            package.model(images, token_ids)
    for images in [torch.rand(3, 50, 50), torch.rand(1, 3, 1, 50), torch.rand(1, 1, 50, 50), torch.rand(0, 3, 9, 9)]:
        with pytest.raises(InputError):
            package.transforms(images)


def test_prompts_empty_or_too_long(package_path, caplog):
    package = load_package(package_path)
    for prompts in [[""], ["  "], [], "a cat"]:
        with pytest.raises(InputError):
            package.encode_prompts(prompts)
    with caplog.at_level("WARNING", logger="sam3_aoti"):
        ids = package.encode_prompts([" ".join(["roof"] * 40)])
    assert ids[0, -1].item() == 49407  # end token kept, words cut
    assert "is 40 tokens long; the model reads 30: the last 10 are dropped" in caplog.text


def test_sixteen_bit_and_other_image_modes_become_rgb8(tmp_path):
    ramp = np.linspace(0, 65535, 40 * 50).reshape(40, 50).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    rgb = image_reader.read_image(tmp_path / "g16.png")
    assert rgb.dtype == np.uint8 and rgb.shape == (40, 50, 3)
    np.testing.assert_allclose(rgb[..., 0], ramp / 257, atol=1)  # scaled, not clipped to white
    Image.fromarray((ramp // 256).astype(np.uint8)).convert("P").save(tmp_path / "palette.png")
    Image.new("RGBA", (7, 5), (10, 20, 30, 40)).save(tmp_path / "rgba.png")
    assert image_reader.read_image(tmp_path / "palette.png").shape == (40, 50, 3)
    alpha = 40 / 255  # over white, as a viewer on a white page shows it
    assert image_reader.read_image(tmp_path / "rgba.png")[0, 0].tolist() == [round(c * alpha + 255 * (1 - alpha))
                                                                              for c in (10, 20, 30)]


def test_an_oversized_image_is_refused_with_the_limit(tmp_path, monkeypatch):
    Image.new("RGB", (400, 300)).save(tmp_path / "big.png")
    monkeypatch.setattr(image_reader, "MAX_PIXELS", 100_000)
    with pytest.raises(PackageError, match=r"400 x 300 .* over the 0 MP limit: tile it"):
        image_reader.read_image(tmp_path / "big.png")


def test_predict_checks_outputs_before_loading_anything(tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    (tmp_path / "out.png").mkdir()
    (tmp_path / "file").write_text("a file, not a folder")
    for output, words in [("out", "out.png is a folder"), ("file/x", "cannot create")]:
        proc = predict("missing.pt2", "--image", "roof.png", "--prompt", "a roof", "--output", output, cwd=tmp_path)
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr  # not "no package at": checked first
        assert len(proc.stderr.strip().splitlines()) == 1


def test_predict_into_an_existing_folder_writes_inside_it(package_path, tmp_path):
    """`--output FOLDER` puts FOLDER/<image stem>_sam3.png and .json inside the folder, nothing beside it."""
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    (tmp_path / "results").mkdir()
    proc = predict(str(package_path), "--image", "roof.png", "--prompt", "a roof", "--output", "results",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["roof_sam3.json", "roof_sam3.png"]
    assert not (tmp_path / "results.png").exists() and not (tmp_path / "results.json").exists()


def test_predict_on_a_damaged_package_is_one_line(package_path, tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    (tmp_path / "truncated.pt2").write_bytes(package_path.read_bytes()[:100_000])
    (tmp_path / "text.pt2").write_text("not a package")
    for name in ("truncated.pt2", "text.pt2"):
        proc = predict(name, "--image", "roof.png", "--prompt", "a roof", cwd=tmp_path)
        assert proc.returncode != 0 and "truncated or not a sam3-aoti package" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_output_into_a_closed_pipe_is_quiet(package_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for command in (f"{sys.executable} -m sam3_aoti info {package_path} | head -c 10",
                    f"{sys.executable} -m doit list | head -c 10"):
        proc = subprocess.run(command, shell=True, cwd=package_path.parents[3], env=env, capture_output=True, text=True)
        assert proc.stderr == "", (command, proc.stderr)


def test_a_failed_predict_removes_the_folder_it_made(package_path, tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    proc = predict(str(tmp_path / "none.pt2"), "--image", "roof.png", "--prompt", "a roof", "--output", "new/deep/x",
                   cwd=tmp_path)
    assert proc.returncode == 2 and "no package at" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_images_are_read_as_a_viewer_shows_them(tmp_path):
    """EXIF orientation applied, CMYK and float greys converted, the same reader for predict and the cases."""
    from sam3_aoti.pipeline.cases import Case

    portrait = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = portrait.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to view": a phone held upright
    portrait.save(tmp_path / "phone.jpg", exif=exif)
    assert image_reader.read_image(tmp_path / "phone.jpg").shape == (40, 20, 3)
    assert Case("phone", str(tmp_path / "phone.jpg"), ("a wall",)).load_image().shape == (40, 20, 3)
    Image.new("CMYK", (8, 6), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    assert image_reader.read_image(tmp_path / "cmyk.jpg")[0, 0].tolist()[0] > 200  # red, not black
    Image.fromarray(np.full((5, 7), 0.5, np.float32), mode="F").save(tmp_path / "float.tif")
    assert image_reader.read_image(tmp_path / "float.tif")[0, 0].tolist() == [128, 128, 128]
    assert image_reader.array_to_rgb8(np.full((3, 4), 65535, np.uint16))[0, 0].tolist() == [255, 255, 255]


def test_segment_reads_each_image_as_the_bytes_of_predicts_array(tmp_path):
    """`decode_image(..., as_bytes=True)` (segment's decoding: no array, no copies) gives the bytes and size of
    `read_image`'s array for every kind of file the reader converts."""
    portrait = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = portrait.getexif()
    exif[0x0112] = 6
    portrait.save(tmp_path / "phone.jpg", exif=exif)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (30, 41, 3), dtype=np.uint8)).save(tmp_path / "rgb.png")
    Image.fromarray(rng.integers(0, 256, (30, 41, 3), dtype=np.uint8)).save(tmp_path / "rgb.jpg")
    Image.fromarray(rng.integers(0, 65536, (9, 8), dtype=np.uint16)).save(tmp_path / "g16.png")
    Image.fromarray(rng.integers(0, 256, (9, 8, 4), dtype=np.uint8), mode="RGBA").save(tmp_path / "rgba.png")
    Image.new("CMYK", (8, 6), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    Image.fromarray(rng.integers(0, 256, (9, 8), dtype=np.uint8)).convert("P").save(tmp_path / "palette.png")
    for path in sorted(tmp_path.iterdir()):
        array = image_reader.read_image(path)
        assert image_reader.decode_image(path, path, as_bytes=True) == (array.tobytes(), array.shape[:2]), path.name


@pytest.mark.parametrize("text", ["nan,0,10,10", "0,0,inf,10", "0,0,10", "a,b,c,d"])
def test_a_box_that_is_not_four_finite_numbers_is_one_line(text):
    from sam3_aoti.runtime.exemplars import parse_box

    with pytest.raises(InputError, match=r"is not X0,Y0,X1,Y1: give four finite numbers"):
        parse_box(text)


def test_a_corner_that_is_not_a_number_is_named_wherever_a_box_enters():
    """NaN passes every comparison: the Python API's pixel corners (and cases.toml's, through check_corners)
    name the box instead of reaching the package."""
    from sam3_aoti.runtime.exemplars import check_corners, normalized_boxes

    for check in (lambda c: check_corners(c, 100, 80), lambda c: normalized_boxes(c, [1], 100, 80)):
        with pytest.raises(InputError, match=r"box nan,0,10,10 holds a coordinate that is not a finite number"):
            check([(float("nan"), 0, 10, 10)])


def segment_in_process(capsys, *args: str) -> tuple[int, str]:
    from sam3_aoti.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["segment", *args])
    return stopped.value.code, capsys.readouterr().err


def test_segment_checks_prompts_and_boxes_before_ray_starts(tmp_path, capsys):
    """`--box -5,10,50,40` is a box (argparse took it for an option), refused for what is wrong with it; an empty
    prompt is one line; both before Ray or the package is touched."""
    folder = tmp_path / "tiles"
    folder.mkdir()
    Image.new("RGB", (64, 48)).save(folder / "a.png")
    common = ["--package", str(tmp_path / "none.pt2"), "--output", str(tmp_path / "out")]
    code, err = segment_in_process(capsys, str(folder), *common, "--prompt", "a roof", "--box", "-5,10,50,40",
                                   "--boxes-on", str(folder / "a.png"))
    assert code == 2 and "box -5,10,50,40 is outside the 64 x 48 image" in err, err
    code, err = segment_in_process(capsys, str(folder), *common, "--prompt", "")
    assert code == 2 and "prompt '' is empty" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_predict_takes_a_negative_box_as_a_box():
    from sam3_aoti.cli import boxes_as_values

    assert boxes_as_values(["predict", "p", "--box", "-5,10,50,60", "--negative-box", "-.5,1,2,3", "--prompt", "-x"]) \
        == ["predict", "p", "--box=-5,10,50,60", "--negative-box=-.5,1,2,3", "--prompt", "-x"]


def test_a_request_is_checked_without_importing_torch():
    """segment's driver checks the prompts before Ray starts, and never needs torch (a second of its start-up)."""
    check = ("import sys; from sam3_aoti.runtime.inference import check_request; check_request(['a dog'], [], 0.5); "
             "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
