#include "common/cluster/model_fingerprint.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <memory>
#include <vector>

#include "common/error.h"
#include "common/format.h"
#include "common/model/gguf.h"

namespace duet {
namespace {

constexpr uint64_t kSamples = 64;
constexpr uint64_t kSampleBytes = 4096;

struct DigestDeleter {
  void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
};

}  // namespace

std::string model_fingerprint(const std::string& path) {
  // The header's extent (and the check that it is GGUF at all).
  const GgufFile file = GgufFile::open(path);
  const uint64_t size = file.file_size();
  const uint64_t data = std::min(file.data_offset(), size);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorKind::kNotFound, format("model fingerprint: cannot read {}", path));
  std::unique_ptr<EVP_MD_CTX, DigestDeleter> context(EVP_MD_CTX_new());
  DUET_ASSERT(context && EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) == 1,
              "SHA-256 unavailable");
  auto hash = [&](const void* bytes, size_t n) {
    DUET_ASSERT(EVP_DigestUpdate(context.get(), bytes, n) == 1, "SHA-256 update");
  };
  auto hash_range = [&](uint64_t from, uint64_t n) {
    std::vector<char> buffer(static_cast<size_t>(std::min<uint64_t>(n, 1 << 20)));
    in.seekg(static_cast<std::streamoff>(from));
    while (n > 0) {
      const auto chunk = static_cast<std::streamsize>(std::min<uint64_t>(n, buffer.size()));
      if (!in.read(buffer.data(), chunk)) {
        throw Error(ErrorKind::kCorruptFile,
                    format("model fingerprint: {} ends before byte {}", path, from + n));
      }
      hash(buffer.data(), static_cast<size_t>(chunk));
      n -= static_cast<uint64_t>(chunk);
    }
  };
  hash(&size, sizeof size);
  hash_range(0, data);
  const uint64_t weights = size - data;
  if (weights > 0) {
    for (uint64_t i = 0; i < kSamples; ++i) {
      const uint64_t at = data + (weights - std::min(weights, kSampleBytes)) * i / (kSamples - 1);
      hash_range(at, std::min(kSampleBytes, size - at));
    }
  }
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int n = 0;
  DUET_ASSERT(EVP_DigestFinal_ex(context.get(), digest.data(), &n) == 1, "SHA-256 final");
  std::string out = "sha256:";
  constexpr char kHex[] = "0123456789abcdef";
  for (unsigned int i = 0; i < n; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

}  // namespace duet
