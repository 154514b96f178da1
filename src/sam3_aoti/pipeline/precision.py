"""What each precision means, in one table every stage reads (no stage compares precision strings).

torch-free: dtypes are named as `torch` spells them (`getattr(torch, p.dtype)`), so doit can load it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.contract import FP8_PARTS, FP32_IN_BF16


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: str  # the compute dtype of the package (torch's name)
    fp32_parts: tuple[str, ...]  # submodules kept in fp32 (model.mixed_precision.keep_box_path_fp32 says why)
    fp8_parts: tuple[str, ...]  # submodules whose linears run as rowwise-scaled fp8 GEMMs (model.fp8)
    needs_cuda: bool
    export_atol: float  # max |exported - eager| the export stage accepts at new shapes
    reference: str  # the precision of the eager model verify gates the package against
    strict_fp32: bool  # TF32 off wherever outputs are compared (`without_tf32`)
    parity: str  # how Meta runs its model for `parity`: "plain" (TF32 off) or "autocast" (bf16)
    summary: str

    @property
    def tolerances(self) -> str:
        """The [verify.tolerances.<name>] and [parity.tolerances.<name>] tables of pipeline.toml."""
        return self.name

    @property
    def reference_dtype(self) -> str:
        return PRECISIONS[self.reference].dtype


PRECISIONS = {
    "fp32": Precision("fp32", "float32", (), (), needs_cuda=False, export_atol=1e-4, reference="fp32",
                      strict_fp32=True, parity="plain", summary="fp32 throughout, TF32 off where verified"),
    "bf16": Precision("bf16", "bfloat16", FP32_IN_BF16, (), needs_cuda=True, export_atol=5e-2, reference="bf16",
                      strict_fp32=False, parity="autocast",
                      summary=f"bf16, with {', '.join(FP32_IN_BF16)} in fp32"),
    # Meta has no fp8: verify gates fp8 against the bf16 model, so every row is what the fp8 linears cost, and
    # parity compares it with Meta's model under bf16 autocast at limits of its own ([parity.tolerances.fp8]).
    "fp8": Precision("fp8", "bfloat16", FP32_IN_BF16, FP8_PARTS, needs_cuda=True, export_atol=5e-2, reference="bf16",
                     strict_fp32=False, parity="autocast",
                     summary=f"bf16 with the linears of {', '.join(FP8_PARTS)} as fp8 GEMMs"),
}


def without_tf32(precision: Precision) -> None:
    """For a strict fp32 precision, TF32 off in this process. PyTorch runs cuDNN convolutions in TF32 by default
    (about 1e-3 off fp32): eager's outputs (the `reference` stage's cache), the package's and the fallback's must all
    be real fp32, or verify holds TF32's error to fp32's limits."""
    if precision.strict_fp32:
        import torch

        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
