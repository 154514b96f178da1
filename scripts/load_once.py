"""Load a package with the runtime alone and run one 1 x 1 call: what "a loadable package" means in the
binary cache's H200 figures (scripts/gpu_full.sh part cache). Prints one line with the seconds."""

import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

from sam3_aoti import load_package  # noqa: E402

package = load_package(sys.argv[1])
loaded = time.perf_counter() - t0
images = torch.zeros(1, 3, 1008, 1008, device="cuda")
outputs = package.model(images, package.encode_prompts(["a building"]).cuda())
torch.cuda.synchronize()
print(f"imported torch and loaded in {loaded:.1f} s, first 1 x 1 call done at {time.perf_counter() - t0:.1f} s "
      f"(backend {package.backends['model']}, logits {tuple(outputs[0].shape)})")
