"""Write tests/data/transformers_sam3_key_mapping.txt: where transformers' own SAM3 conversion script puts
each key of Meta's detector (tests/data/meta_sam3_detector_keys.txt), so the tests can hold
`meta_checkpoint.KEY_MAP` against it. The script is not in the transformers wheel, only in its repository.

Usage: python scripts/make_transformers_key_fixture.py CONVERT_SAM3_TO_HF_PY COMMIT
  CONVERT_SAM3_TO_HF_PY  src/transformers/models/sam3/convert_sam3_to_hf.py of huggingface/transformers
  COMMIT                 the commit it was taken from (recorded in the fixture's header)
"""

import importlib.util
import sys
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def main() -> None:
    script, commit = Path(sys.argv[1]), sys.argv[2]
    spec = importlib.util.spec_from_file_location("convert_sam3_to_hf", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    meta_keys = [line.split()[0].removeprefix("detector.")
                 for line in (DATA / "meta_sam3_detector_keys.txt").read_text().splitlines()]
    renamed = convert.convert_old_keys_to_new_keys(meta_keys)
    lines = [f"# Meta key -> transformers key(s), by convert_sam3_to_hf.py at huggingface/transformers@{commit}",
             "# (convert_old_keys_to_new_keys, then split_qkv). Written by scripts/make_transformers_key_fixture.py."]
    for key in meta_keys:
        split = convert.split_qkv({renamed[key]: torch.zeros(3)})  # fused q/k/v become three keys
        lines.append(" ".join([key, *split]))
    (DATA / "transformers_sam3_key_mapping.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
