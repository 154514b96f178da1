"""Can SAM3's ViT layers be compiled once as a repeated block under AOTInductor, to cut compile time?

`torch.compiler.nested_compile_region` marks a function whose calls torch.compile traces and compiles once
(an `invoke_subgraph`). This exports a small SAM3 ViT (the tiny profile's sizes, LAYERS layers, every fourth
global) with its windowed and its global layers as two such regions, then compiles it with AOTInductor, and
prints what each step did: the export's invoke_subgraph nodes, the compile time, the output's distance from
eager, or the first line of the error. With `plain` the layers are left unmarked (the baseline).
Usage: python experiments/regional_compile.py [LAYERS] [regions|plain] [strict|nonstrict]   (CPU is enough)
"""

import sys
import time

import torch
from transformers.models.sam3.configuration_sam3 import Sam3ViTConfig
from transformers.models.sam3.modeling_sam3 import Sam3ViTLayer, Sam3ViTModel


class Trunk(torch.nn.Module):
    def __init__(self, vit):
        super().__init__()
        self.vit = vit

    def forward(self, images):
        return self.vit(images).last_hidden_state


def mark_layers_as_regions() -> None:
    """Windowed and global layers differ in shapes, so each kind is a region of its own."""
    forward = Sam3ViTLayer.forward

    @torch.compiler.nested_compile_region
    def windowed(layer, hidden):
        return forward(layer, hidden)

    @torch.compiler.nested_compile_region
    def global_(layer, hidden):
        return forward(layer, hidden)

    Sam3ViTLayer.forward = lambda layer, hidden, **kwargs: (windowed if layer.window_size else global_)(layer, hidden)


def main(layers: int, mode: str, strict: bool) -> None:
    config = Sam3ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
                           image_size=112, patch_size=14, window_size=4, global_attn_indexes=list(range(3, layers, 4)),
                           pretrain_image_size=112)
    torch.manual_seed(0)
    trunk = Trunk(Sam3ViTModel(config).eval())
    if mode == "regions":
        mark_layers_as_regions()
    images = torch.randn(2, 3, 112, 112)
    step = "export"
    try:
        with torch.no_grad():
            eager = trunk(images)
            t0 = time.perf_counter()
            program = torch.export.export(trunk, (images,), strict=strict,
                                          dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
            exported_s = time.perf_counter() - t0
            regions = sum("invoke_subgraph" in str(node.target) for node in program.graph.nodes)
            step = "AOTInductor"
            t0 = time.perf_counter()
            runner = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(program))
            compiled_s = time.perf_counter() - t0
            diff = (runner(images) - eager).abs().max().item()
    except Exception as e:  # the finding is the error itself
        print(f"{layers} layers, {mode}, {'strict' if strict else 'non-strict'} export: {step} failed: "
              f"{type(e).__name__}: {str(e).splitlines()[0]}")
        return
    print(f"{layers} layers, {mode}, {'strict' if strict else 'non-strict'} export: exported in {exported_s:.1f} s "
          f"({regions} invoke_subgraph nodes), compiled in {compiled_s:.1f} s, max |AOTI - eager| = {diff:.1e}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 8, args[1] if len(args) > 1 else "regions",
         (args[2] if len(args) > 2 else "strict") == "strict")
