// sam3_consumer PACKAGE [HEIGHT WIDTH [TOKEN_ID ...]]
// Loads a sam3-aoti package with libtorch alone, runs `transforms` then `model` on an image tensor, prints
// the output shapes and the top score (sigmoid(pred_logits) * sigmoid(presence_logit_dec)).
// Token ids are CLIP BPE ids (start 49406, end 49407, pad 0; the package's metadata.json has the constants):
// tokenize in your service, or with `sam3_aoti.encode_prompts`. The default is "a dog".
// It checks no digest: a service copies the package into a folder only it can write, compares the copy's
// sha256 with the digest it trusts, and loads the copy (docs/package.md, "From C++").
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

const char* kOutputs[] = {"pred_logits", "pred_boxes", "pred_masks", "presence_logit_dec"};
constexpr int64_t kContext = 32;

// A smooth synthetic RGB picture in [0, 255], [1, 3, H, W]: stands in for a decoded image.
torch::Tensor synthetic_image(int64_t height, int64_t width) {
  auto y = torch::arange(height, torch::kFloat).view({1, 1, height, 1});
  auto x = torch::arange(width, torch::kFloat).view({1, 1, 1, width});
  auto c = torch::arange(3, torch::kFloat).view({1, 3, 1, 1});
  return 127.5 * (1 + torch::sin(0.05 * y + 0.03 * x + c));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc < 4) {
    std::cerr << "usage: sam3_consumer PACKAGE [HEIGHT WIDTH [TOKEN_ID ...]]\n";
    return 2;
  }
  const std::string path = argv[1];
  const int64_t height = argc >= 4 ? std::stoll(argv[2]) : 480;
  const int64_t width = argc >= 4 ? std::stoll(argv[3]) : 640;
  std::vector<int64_t> tokens;
  for (int i = 4; i < argc; ++i) tokens.push_back(std::stoll(argv[i]));
  if (tokens.empty()) tokens = {49406, 320, 1929, 49407};
  if (static_cast<int64_t>(tokens.size()) > kContext) {
    std::cerr << "at most " << kContext << " token ids\n";
    return 2;
  }

  try {
    torch::NoGradGuard no_grad;
    torch::inductor::AOTIModelPackageLoader transforms(path, "transforms");
    torch::inductor::AOTIModelPackageLoader model(path, "model");
    const torch::Device device(transforms.get_metadata()["AOTI_DEVICE_KEY"] == "cuda" ? torch::kCUDA : torch::kCPU);

    auto ids = torch::zeros({1, kContext}, torch::kLong);
    for (size_t i = 0; i < tokens.size(); ++i) ids[0][static_cast<int64_t>(i)] = tokens[i];
    auto pixels = transforms.run({synthetic_image(height, width).to(device)})[0];
    auto outputs = model.run({pixels, ids.to(device)});

    std::cout << "images " << pixels.sizes() << "\n";
    for (size_t i = 0; i < outputs.size() && i < 4; ++i) std::cout << kOutputs[i] << " " << outputs[i].sizes() << "\n";
    auto scores = (outputs[0].select(-1, 0).sigmoid() * outputs[3].sigmoid()).cpu();
    auto best = scores.flatten().argmax().item<int64_t>();
    std::printf("top score %.7f at query %lld\n", scores.flatten()[best].item<float>(), static_cast<long long>(best));
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::cerr << "sam3_consumer: " << what.substr(0, what.find('\n')) << "\n";
    return 1;
  }
  return 0;
}
