#!/usr/bin/env python3
"""Which fp8 pieces of the ViT's MLP run under AOTInductor (torch 2.11): each exported alone with a dynamic token
count, compiled into a package, loaded and run at another count, against the module run eagerly.
  - fc2 on 1 x 128 groups through `F.scaled_mm` (blockwise, aten._scaled_mm_v2, which AOTInductor calls through its
    proxy executor);
  - the same through `torch._scaled_mm` (v1, which has a C shim), scales shaped as its check asks;
  - the MLP as precision=fp8 builds it (`sam3_aoti.model.fp8.Fp8Mlp`: the fused fc1 kernel, fc2 in bf16);
  - the fused fc1 writing groups, then fc2's blockwise product in the project's Triton kernel (gelu_groups.py).
One line each: OK with the largest difference relative to the largest output, or FAIL with the error's first line.
Usage: python3 experiments/fp8_aoti_pieces.py   (on a GPU with fp8 tensor cores)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from sam3_aoti.model.fp8 import Fp8Mlp  # noqa: E402
from sam3_aoti.toolchain.compiler_fixes import links_libstdcxx_statically, shared_libstdcxx_compilers  # noqa: E402

import gelu_groups  # noqa: E402  (this folder's)
import vit_mlp_fp8  # noqa: E402  (this folder's: its MLP and the blockwise Triton op)


class ScaledMmV1Groups(nn.Module):
    """fc2's blockwise product through `torch._scaled_mm` (v1): scale_a `[M, K/128]`, scale_b `[K/128, N/128]`."""

    def __init__(self, group_linear: gelu_groups.Fp8GroupLinear):
        super().__init__()
        self.g = group_linear

    def forward(self, x):
        groups, scales = gelu_groups.quantize_groups(x)
        blocks = self.g.in_features // gelu_groups.GROUP
        return torch._scaled_mm(groups, self.g.weight.t(), scale_a=scales.t(),
                                scale_b=self.g.weight_scale[:, :blocks].t(), out_dtype=torch.bfloat16) + self.g.bias


def main() -> None:
    scratch = Path(tempfile.mkdtemp())
    if links_libstdcxx_statically("g++", scratch / "cxx"):  # as the toolchain stage picks the compiler
        import torch._inductor.config as inductor_config

        inductor_config.cpp.cxx = (None, shared_libstdcxx_compilers("g++", scratch / "cxx")[0])
    from transformers import Sam3Config
    from transformers.models.sam3.modeling_sam3 import Sam3MLP

    torch.manual_seed(0)
    group_linear = gelu_groups.Fp8GroupLinear(nn.Linear(4736, 1024)).cuda()
    mlp = Sam3MLP(Sam3Config().vision_config.backbone_config).to(torch.bfloat16)
    base = vit_mlp_fp8.Mlp(torch.bfloat16).cuda()
    cases = [("fc2 groups, F.scaled_mm", group_linear, 4736), ("fc2 groups, torch._scaled_mm", ScaledMmV1Groups(
        group_linear), 4736), ("Fp8Mlp (precision=fp8)", Fp8Mlp(mlp).cuda(), 1024),
        ("fc1 groups, fc2 Triton blocks", vit_mlp_fp8.FusedGroups(base, triton=True), 1024)]
    tokens = torch.export.Dim("tokens", min=16)
    for name, module, width in cases:
        try:
            example = torch.randn(2 * 5184, width, device="cuda", dtype=torch.bfloat16)
            module(example)  # eager first: a kernel that refuses the recipe fails here, before any compile
            program = torch.export.export(module, (example,), dynamic_shapes=({0: 16 * tokens},))
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(scratch / f"{len(name)}.pt2"))
            compiled = torch._inductor.aoti_load_package(package)
            x = torch.randn(3 * 5184, width, device="cuda", dtype=torch.bfloat16)
            got, want = compiled(x).float(), module(x).float()
            print("OK", name, float((got - want).abs().max() / want.abs().max()), flush=True)
        except Exception as e:  # the next piece still runs
            print("FAIL", name, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "", flush=True)


if __name__ == "__main__":
    main()
