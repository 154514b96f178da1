"""The tiny chain on a GPU (skipped without CUDA): toolchain doctor, CUDA AOTI package, verify gates."""

import importlib.util
import json
import os

import pytest

from helpers import (REPO, TINY_MODELS, copy_repo, executed, overlapping_calls_give_each_batchs_rows, run_doit,
                     stale)
from sam3_aoti.toolchain.cuda_toolkit import load_pins

# `SAM3_AOTI_TEST_TOOLKIT=machine` builds the tuned chain with the machine's toolkit (a GPU box without PyPI)
TOOLKIT = [f"toolkit={os.environ['SAM3_AOTI_TEST_TOOLKIT']}"] if os.environ.get("SAM3_AOTI_TEST_TOOLKIT") else []


@pytest.mark.gpu
def test_tiny_pipeline_on_cuda(tmp_path):
    repo = copy_repo(tmp_path)
    run_doit(repo, "device=cuda")
    doctor = json.loads((repo / "artifacts" / "toolchain" / "doctor.json").read_text())
    probe = json.loads((repo / "artifacts" / "toolchain" / "probe.json").read_text())  # run before the compile
    assert probe["ok"], probe
    assert doctor["toolkit"]["version"] == ".".join(doctor["torch_cuda"].split(".")[:2])
    if load_pins(doctor["toolkit"]["version"]):  # hermetic by default: the pinned wheels, not the machine's
        assert doctor["toolkit"]["source"] == "pip wheels", doctor["toolkit"]
    art = repo / "artifacts" / "tiny-fp32-cuda"
    assert json.loads((art / "verify" / "report.json").read_text())["passed"]
    from sam3_aoti.runtime.loader import load_package

    package = load_package(art / "package" / "sam3.pt2")
    assert package.backends == dict.fromkeys(TINY_MODELS, "aoti")
    assert package.metadata["device"] == "cuda" and package.metadata["versions"]["gpu"]
    check_cuda_graphs(art / "package" / "sam3.pt2")


@pytest.mark.gpu
def test_a_tuned_tiny_build_on_cuda_compiles_from_its_tuning_results(tmp_path):
    """`[tune] enabled = true`: doit runs tune before compile; compile reads every decision from the tuning
    results (benchmarks nothing) and its code reads no tensor derived from the weights; verify passes; a new
    seed, once weights and the exports have rerun, leaves tune and the compiles up to date. The Triton search is cut to
    one config per GEMM (Inductor's own test_configs.max_mm_configs, so ATen vs Triton still benchmarks): with
    the full search the tiny model's tuning took 9-10 minutes on the H200, beside a full build."""
    repo = copy_repo(tmp_path)
    config = repo / "pipeline.toml"
    text = config.read_text().replace("\nenabled = false\n", "\nenabled = true\n")
    tune_options = 'max_autotune_gemm_backends = "ATEN,TRITON"'
    assert tune_options in text
    config.write_text(text.replace(tune_options, f'{tune_options}, "test_configs.max_mm_configs" = 1'))
    run_doit(repo, "device=cuda", *TOOLKIT)
    art = repo / "artifacts" / "tiny-fp32-cuda"
    tuning = json.loads((art / "tuning" / "index.json").read_text())
    assert tuning["gemm_layouts"] > 0 and tuning["key"]["gpu"] and tuning["tune_seconds"]["model"] > 0
    for index in ("compiled", "compiled_parts"):
        compiled = json.loads((art / index / "index.json").read_text())
        assert set(compiled["tuning"]["benchmarked_now"].values()) == {0}, compiled["tuning"]
        assert compiled["inductor_options"]["max_autotune_gemm"] is True
    assert json.loads((art / "verify" / "report.json").read_text())["passed"]
    config.write_text(config.read_text().replace("\nseed = 0\n", "\nseed = 1\n"))
    assert {"weights", "export", "export_parts"} <= executed(run_doit(repo, "export", "export_parts", "device=cuda",
                                                                      *TOOLKIT))
    rerun = stale(repo, *TOOLKIT, device="cuda")
    assert "package" in rerun and not {"tune", "compile", "compile_parts"} & rerun, rerun


@pytest.mark.gpu
def test_cuda_graphs_of_the_repositorys_tiny_cuda_build():
    """The same check on this checkout's own tiny CUDA build (`doit device=cuda`), where one exists."""
    path = REPO / "artifacts" / "tiny-fp32-cuda" / "package" / "sam3.pt2"
    if not path.is_file():
        pytest.skip("no tiny CUDA build in this checkout: run `uv run doit device=cuda`")
    check_cuda_graphs(path)


def check_cuda_graphs(path):
    """Graphs on (the default) vs off at several shapes (new inputs each call: a stale replay would be far
    off); a shape's first call returns its warm-up's outputs, a shape seen again replays its graph, and at most
    max_graphs are kept. A split package's model is the split call by default on CUDA, and the whole compiled
    model with split_call=False; each is checked against itself without graphs (the same kernels)."""
    import torch

    from sam3_aoti.model.configs import example_inputs, tiny_config
    from sam3_aoti.runtime.loader import load_package

    graphed, plain = load_package(path, max_graphs=2), load_package(path, cuda_graphs=False)
    assert graphed.cuda_graphs == "on" and plain.cuda_graphs == "off: cuda_graphs=False"
    assert graphed.split_call == plain.split_call == bool(graphed.parts)
    whole = load_package(path, max_graphs=2, split_call=False) if graphed.parts else None
    for call, (b, p) in enumerate([(1, 1), (1, 1), (2, 3), (2, 3), (1, 1), (3, 2), (3, 2)]):
        args = example_inputs(tiny_config(), b, p, seed=call, device="cuda")
        for got, want in zip(graphed.model(*args), plain.model(*args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"B={b} P={p}")
        for got, want in zip(whole.model(*args) if whole else (), plain["model"](*args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"whole model, B={b} P={p}")
    for runner in (graphed.graph_runner, *((whole.graph_runner,) if whole else ())):
        assert runner.failed is None, runner.failed
        assert runner.captures == 3 and len(runner.graphs) == 2
    if graphed.parts:  # text and boxes through the split call and the graphed parts, equal to the call without graphs
        from sam3_aoti.model.exporting import example_boxes

        for b, p in [(1, 1), (2, 3)]:
            args = example_inputs(tiny_config(), b, p, seed=b + p, device="cuda")
            boxes = example_boxes(b, 3, seed=b, device="cuda")
            want = plain.model_with_boxes(*args, *boxes)
            for package in (graphed, whole):
                for got, expected in zip(package.model_with_boxes(*args, *boxes), want):
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"boxes B={b} P={p}")
        encode_boxes, with_boxes = (whole.runners["encode_boxes"].graph_runner,
                                    graphed.runners["model_with_boxes"].graph_runner)
        assert encode_boxes.failed is None and encode_boxes.captures == 2, encode_boxes.failed
        assert with_boxes.failed is None and with_boxes.captures == 2, with_boxes.failed


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sam3") is None, reason="needs Meta's sam3 package (scripts/fetch_gpu_wheels.sh)")
def test_parity_with_metas_sam3():
    """Full-size fp32 package vs Meta's implementation on the cases, same weights in Meta's format. Uses the
    repository's artifacts: after `doit compile profile=sam3 weights=random device=cuda` only parity runs."""
    run_doit(REPO, "parity", "profile=sam3", "weights=random", "device=cuda", "precision=fp32")
    report = json.loads((REPO / "artifacts" / "sam3-fp32-cuda" / "parity" / "parity.json").read_text())
    assert report["passed"], [row for row in report["rows"] if not row["ok"]]
    assert len(report["cases"]) >= 6 and all(case["top1_same"] == 1.0 for case in report["cases"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_box_bias_kernel_on_cuda_is_the_mlp_eager_and_compiled(dtype):
    """`box_bias_kernel` on the GPU, as a bf16 or fp32 build runs it: the op (eager and under torch.compile, which
    compiles the Triton kernel as AOTInductor does) against the MLP in fp32 at SAM3's sizes (256 wide, 8 heads,
    200 queries, 72 coordinates)."""
    import torch
    from transformers.models.sam3.modeling_sam3 import Sam3DecoderMLP

    from sam3_aoti.model.optimizations.box_bias_kernel import box_bias_mlp

    torch.manual_seed(0)
    mlp = Sam3DecoderMLP(2, 256, 8, 2).cuda()
    deltas = torch.randn(3, 200, 72, 2, device="cuda")
    with torch.no_grad():
        want = mlp(deltas).permute(0, 3, 1, 2)
        mlp.to(getattr(torch, dtype))
        eager, compiled = box_bias_mlp(deltas, mlp), torch.compile(box_bias_mlp, fullgraph=True)(deltas, mlp)
    tolerance = 1e-4 if dtype == "float32" else 3e-2 * float(want.abs().max())
    for got in (eager, compiled):
        assert got.shape == (3, 8, 200, 72) and got.dtype == torch.float32
        assert float((got - want).abs().max()) < tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["detr", "biased", "vit", "vit global"])
def test_the_attention_kernel_on_cuda_is_sdpa_eager_and_compiled(case):
    """`attention_kernel`, `grid_bias_attention` and `vit_attention_kernel` on the GPU, as a bf16 build runs them:
    the op (eager and under torch.compile, which compiles the Triton kernel as AOTInductor does) on strided bf16
    views at SAM3's sizes (8 heads of 32, 72 x 72 image tokens; 201 queries with the box bias on all but the first,
    the presence token, as `decoder_shared_projections` hands it; the ViT's 16 heads of 64 over two images' 9
    windows of 576 tokens, and over its global 5,184, each with tiles of its own) against fp32 SDPA on the same
    values."""
    import torch
    import torch.nn.functional as F

    from sam3_aoti.runtime.attention import grid_bias

    torch.manual_seed(0)
    biased = case == "biased"
    pairs, heads, dim, keys, queries = {"detr": (3, 8, 32, 72 * 72, 72 * 72), "biased": (3, 8, 32, 72 * 72, 201),
                                        "vit": (18, 16, 64, 576, 576), "vit global": (2, 16, 64, 5184, 5184)}[case]
    q, k, v = (torch.randn(pairs, length, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for length in (queries, keys, keys))
    tables = [torch.randn(pairs, heads, queries - 1, 72, device="cuda") for _ in range(2)] if biased else [None] * 2
    mask = F.pad(grid_bias(*tables), (0, 0, 1, 0)) if biased else None
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=dim ** -0.5)
    op = lambda q, k, v, y, x: torch.ops.sam3_aoti.attention(q, k, v, dim ** -0.5, y, x)
    for got in (op(q, k, v, *tables), torch.compile(op, fullgraph=True)(q, k, v, *tables)):
        assert got.shape == (pairs, queries, heads, dim) and got.dtype == torch.bfloat16
        assert float((got.float() - want.transpose(1, 2)).abs().max()) < 2e-2 * float(want.abs().max())


@pytest.mark.gpu
def test_the_fp8_fc1_kernel_on_cuda_is_its_torch_form_eager_and_compiled():
    """`sam3_aoti::fp8_linear_gelu` on the GPU, as a precision=fp8 build's MLP runs fc1: the op (eager and under
    torch.compile, which compiles the Triton kernel as AOTInductor does) at SAM3's widths (1024 -> 4736, the last
    256-wide tile half outside) against its torch form, row counts that fill a tile and that do not. The SFU's tanh
    is about 2^-11 off, under bf16's own rounding."""
    import torch

    from sam3_aoti.model.fp8 import check_fp8_device, quantize_rows
    from sam3_aoti.runtime import fp8_linear

    if check_fp8_device(torch.device("cuda")):
        pytest.skip(check_fp8_device(torch.device("cuda")))
    torch.manual_seed(0)
    weight, weight_scales = quantize_rows(torch.randn(4736, 1024, device="cuda") * 0.03)
    weight_scales = weight_scales.t().contiguous()
    bias = (torch.randn(4736, device="cuda") * 0.5).to(torch.bfloat16)
    op = torch.ops.sam3_aoti.fp8_linear_gelu
    for count in (5184, 5184 * 3 + 7):
        rows, row_scales = quantize_rows(torch.randn(count, 1024, device="cuda", dtype=torch.bfloat16))
        want = fp8_linear.reference(rows, row_scales, weight, weight_scales, bias).float()
        for got in (op(rows, row_scales, weight, weight_scales, bias),
                    torch.compile(op, fullgraph=True)(rows, row_scales, weight, weight_scales, bias)):
            assert got.dtype == torch.bfloat16 and got.shape == (count, 4736)
            assert float((got.float() - want).abs().max()) <= 1e-2 * float(want.abs().max())
            assert float((got.float() - want).norm() / want.norm()) < 4e-3  # bf16's rounding, not more


@pytest.mark.gpu
def test_the_fp8_qkv_rope_kernel_on_cuda_is_its_torch_form_eager_and_compiled():
    """`sam3_aoti::fp8_linear_rope` on the GPU, as `vit_qkv_rope` runs a ViT layer's q, k, v projection: the op (eager
    and under torch.compile, which compiles the Triton kernel as AOTInductor does) at SAM3's widths (1024 -> 3072, q
    and k rotated, 16 heads of 64) for a windowed layer's positions (576) and a global one's (5184), against its
    torch form."""
    import torch

    from sam3_aoti.model.fp8 import check_fp8_device, quantize_rows
    from sam3_aoti.runtime import fp8_linear

    if check_fp8_device(torch.device("cuda")):
        pytest.skip(check_fp8_device(torch.device("cuda")))
    torch.manual_seed(0)
    weight, weight_scales = quantize_rows(torch.randn(3072, 1024, device="cuda") * 0.03)
    weight_scales = weight_scales.t().contiguous()
    bias = (torch.randn(3072, device="cuda") * 0.5).to(torch.bfloat16)
    op = torch.ops.sam3_aoti.fp8_linear_rope
    for positions, count in ((576, 576 * 9 * 3), (5184, 5184 * 2)):
        angles = torch.rand(positions, 32, device="cuda") * 60
        tables = (angles.cos(), angles.sin(), 2048)
        rows, row_scales = quantize_rows(torch.randn(count, 1024, device="cuda", dtype=torch.bfloat16))
        assert fp8_linear.takes_rope(rows, weight, tables[0], 2048)
        want = fp8_linear.rope_reference(rows, row_scales, weight, weight_scales, bias, *tables).float()
        for got in (op(rows, row_scales, weight, weight_scales, bias, *tables),
                    torch.compile(op, fullgraph=True)(rows, row_scales, weight, weight_scales, bias, *tables)):
            assert got.dtype == torch.bfloat16 and got.shape == (count, 3072)
            assert float((got.float() - want).abs().max()) <= 1e-2 * float(want.abs().max())
            assert float((got.float() - want).norm() / want.norm()) < 4e-3  # bf16's rounding, not more


@pytest.mark.gpu
def test_a_graphed_function_on_cuda_gives_its_own_results_on_first_calls_and_replays():
    """`CudaGraphRunner` on the GPU, no package needed: a shape's first call (its warm-up's outputs, made on a side
    stream) and later calls (replays with new inputs) each equal the function run plainly, and no result is
    overwritten by a later call."""
    import torch

    from sam3_aoti.runtime.cuda_graphs import CudaGraphRunner

    weight = torch.randn(256, 256, device="cuda")

    def model(x):
        return [torch.relu(x @ weight) @ weight.t(), x.sum(-1)]

    runner, seen = CudaGraphRunner(model, max_graphs=2), []
    for call, rows in enumerate([64, 64, 128, 64, 128, 32]):
        x = torch.randn(rows, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(call))
        seen.append((x, runner(x)))
    for x, got in seen:
        for g, w in zip(got, model(x)):
            torch.testing.assert_close(g, w)
    assert runner.failed is None and runner.captures == 3 and len(runner.graphs) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_the_split_call_runs_the_text_encoder_on_its_own_stream_and_joins_it(graphs):
    """`SplitCall` on the GPU with stand-in parts: encode_text runs on the side stream (beside encode_image, on
    the caller's), decode reads its output only after it is written (a slow text encoder: an unjoined stream
    would give decode stale features), with and without a CUDA graph around the call, first calls and replays."""
    import torch

    from sam3_aoti.runtime.cuda_graphs import CudaGraphRunner
    from sam3_aoti.runtime.split_call import SplitCall

    weight, streams = torch.randn(512, 512, device="cuda") / 512 ** 0.5, []

    def encode_text(ids):
        streams.append(torch.cuda.current_stream())
        x = ids.float() @ weight
        for _ in range(200):  # long enough that decode would overtake an unjoined stream
            x = torch.tanh(x @ weight)
        return (x,)

    def encode_image(images):
        streams.append(torch.cuda.current_stream())
        return tuple(images * (i + 1) for i in range(7))

    def decode(*tensors):
        return (sum(t.sum() for t in tensors[:6]) + tensors[6].sum(),)

    parts = {"encode_image": encode_image, "encode_text": encode_text, "encode_boxes": None, "decode": decode}
    call = SplitCall(parts, "cuda")
    runner = CudaGraphRunner(call) if graphs else call
    for seed in range(4):
        g = torch.Generator("cuda").manual_seed(seed)
        images, ids = torch.randn(2, 8, device="cuda", generator=g), torch.randn(3, 512, device="cuda", generator=g)
        streams.clear()
        got = runner(images, ids)[0]
        if not graphs or seed == 0:  # a replay runs no Python: the streams are seen at capture
            assert streams[0] == call.side and streams[1] != call.side
        features = encode_image(images)
        want = decode(*features[:6], *encode_text(ids))[0]
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_the_vit_gelu_epilogue_on_cuda_is_the_mlp_within_the_tanh_approximation():
    """`vit_gelu_epilogue` on the GPU at the ViT's sizes (1024 -> 4736 -> 1024, one image's 5,184 tokens): in bf16
    (eager, and compiled as AOTInductor compiles it) its error against the exact MLP in fp32 is within 10 % of what bf16 alone costs, and at most the tanh approximation's
    4.7e-4 per GELU carried through fc2 away from transformers' bf16 MLP; an fp32 MLP stays transformers' exact
    one."""
    import torch
    from transformers.models.sam3.configuration_sam3 import Sam3ViTConfig
    from transformers.models.sam3.modeling_sam3 import Sam3MLP

    from sam3_aoti.model.optimizations.vit_gelu_epilogue import GeluEpilogueMLP

    torch.manual_seed(0)
    plain = Sam3MLP(Sam3ViTConfig(hidden_size=1024, intermediate_size=4736)).cuda().eval()
    x = torch.randn(1, 72, 72, 1024, device="cuda")
    fast = GeluEpilogueMLP(plain.config).cuda().eval()
    fast.load_state_dict(plain.state_dict())
    with torch.no_grad():
        exact = plain(x)
        assert torch.equal(fast(x), exact)  # fp32: transformers' MLP
        plain.bfloat16(), fast.bfloat16()
        bf16 = plain(x.bfloat16()).float()
        bound = 4.7e-4 * float(plain.fc2.weight.float().abs().sum(1).max())  # each GELU off by at most 4.7e-4
        for got in (fast(x.bfloat16()), torch.compile(fast, fullgraph=True)(x.bfloat16())):
            got = got.float()
            assert float((got - exact).norm()) < 1.1 * float((bf16 - exact).norm())
            assert float((got - bf16).abs().max()) < bound + 2 * float((bf16 - exact).abs().max())


@pytest.mark.gpu
def test_pixels_reach_the_gpu_and_results_come_back_unchanged_through_pinned_memory():
    """`postprocess.to_tensor` to CUDA (pinned memory, an asynchronous copy) gives the CPU's floats, for images one
    after another (a pinned block reused only once its copy is done); `to_host` (one copy into pinned memory,
    waited for by an event) gives what `.cpu()` gives."""
    import numpy as np
    import torch

    from sam3_aoti.runtime.postprocess import to_host, to_tensor

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(1008, 1344), (3000, 4000), (7, 5)] * 3]
    on_gpu = [to_tensor(image, "cuda") for image in images]
    for image, tensor in zip(images, on_gpu):
        assert tensor.is_cuda and torch.equal(tensor.cpu(), to_tensor(image))
    tensors = (torch.randn(300, 200, device="cuda") * 1e3, torch.arange(7, device="cuda"),
               torch.rand(5, 3, device="cuda") > 0.5, torch.zeros(0, dtype=torch.uint8, device="cuda"))
    for _ in range(3):
        for tensor, array in zip(tensors, to_host(*(t.clone() for t in tensors))):
            assert np.array_equal(array, tensor.cpu().numpy())


@pytest.mark.gpu
def test_images_of_one_size_reach_the_gpu_in_one_copy_and_come_back_as_each_images_own():
    """`postprocess.transformed` on CUDA (one pinned block and one copy per size, from read-only buffers as Ray's
    object store hands them) gives what each image's own `to_tensor` and call give."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from sam3_aoti.runtime.postprocess import to_tensor, transformed

    def transforms(batch):
        return F.interpolate(batch, size=(64, 64), mode="bilinear", antialias=True) / 127.5 - 1

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, s, dtype=np.uint8) for s in [(300, 400, 3), (50, 60, 3), (300, 400, 3)] * 2]
    images = [torch.frombuffer(memoryview(a.tobytes()), dtype=torch.uint8).view(a.shape) for a in arrays]
    want = torch.cat([transforms(to_tensor(a, "cuda")) for a in arrays])
    for _ in range(3):  # pinned blocks reused once their copies are done
        got = transformed(transforms, images, "cuda")
        assert got.is_cuda and torch.equal(got, want)


@pytest.mark.gpu
def test_overlapping_segment_calls_on_cuda_give_each_batchs_own_rows(tmp_path):
    """A GPU actor's calls overlap (the next batch's model queued behind this one's, the masks on a stream of their
    own, the outputs of one CUDA graph per shape, short batches padded): each batch still gets the rows it gets
    alone. On this checkout's tiny CUDA build (`doit device=cuda`), where one exists."""
    from sam3_aoti.batch import decode_batch
    from sam3_aoti.measure.collection import write_collection

    path = REPO / "artifacts" / "tiny-fp32-cuda" / "package" / "sam3.pt2"
    if not path.is_file():
        pytest.skip("no tiny CUDA build in this checkout: run `uv run doit device=cuda`")
    write_collection(tmp_path, 12, 256, 900, 0)
    decoded = decode_batch({"source": sorted(str(p) for p in tmp_path.iterdir() if p.suffix in (".jpg", ".png"))})
    batches = [decoded.slice(0, 4), decoded.slice(4, 4), decoded.slice(8, 3), decoded.slice(11)]
    overlapping_calls_give_each_batchs_rows(str(path), ["a person", "a cat"], 0.2, batches)
    # the short batches padded to 4 on the graphs' device, as segment runs them
    overlapping_calls_give_each_batchs_rows(str(path), ["a person", "a cat"], 0.2, batches, batch_size=4)
