// GGUF reader: one test per kind of corruption, each naming the error kind, the offset and the
// detail the reader must report. Files come from the in-test writer (gguf_builder.h).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <limits>

#include "common/error.h"
#include "common/model/gguf.h"
#include "tests/common/model/gguf_builder.h"

namespace duet {
namespace {

using namespace gguf_testing;

// The header's fields start at these offsets: magic 0, version 4, tensor count 8, kv count 16,
// and the first pair at 24.

TEST(GgufCorruptTest, Header) {
  expect_error({}, ErrorKind::kCorruptFile, 0, "too short");
  expect_error({'G', 'G', 'U'}, ErrorKind::kCorruptFile, 0, "too short");
  Bytes bytes = GgufBuilder().build();
  bytes[0] = 'X';
  expect_error(bytes, ErrorKind::kCorruptFile, 0, "not a GGUF file (magic 'XGUF'");
  for (uint32_t version : {0u, 1u, 4u}) {
    bytes = GgufBuilder(version).build();
    expect_error(bytes, ErrorKind::kUnsupported, 4, fmt::format("version {}", version));
  }
  bytes = GgufBuilder(0x03000000).build();
  expect_error(bytes, ErrorKind::kUnsupported, 4, "big-endian");
}

TEST(GgufCorruptTest, HugeCounts) {
  Bytes bytes = GgufBuilder().string("k", "v").build();
  patch_u64(bytes, 8, std::numeric_limits<uint64_t>::max());
  expect_error(bytes, ErrorKind::kCorruptFile, 8, "tensor count 18446744073709551615 cannot fit");
  bytes = GgufBuilder().string("k", "v").build();
  patch_u64(bytes, 16, uint64_t{1} << 60);
  expect_error(bytes, ErrorKind::kCorruptFile, 16, "metadata count 1152921504606846976 cannot fit");
  bytes = GgufBuilder().string("k", "v").build();
  patch_u64(bytes, 16, 2);  // one pair more than there is, within the plausible range
  bytes.resize(bytes.size() + 4, 0);
  expect_error(bytes, ErrorKind::kCorruptFile, 46,
               "metadata pair #1: need 8 bytes for a string length, but only 4 are left");
}

TEST(GgufCorruptTest, HugeLengths) {
  Bytes bytes = GgufBuilder().string("key", "value").build();
  patch_u64(bytes, 24, 9223372036854775807);
  expect_error(bytes, ErrorKind::kCorruptFile, 24,
               "key length 9223372036854775807 exceeds the 20 bytes left");
  bytes = GgufBuilder().string("key", "value").build();
  patch_u64(bytes, 24 + 8 + 3 + 4, uint64_t{1} << 40);  // the value's length
  expect_error(bytes, ErrorKind::kCorruptFile, 39,
               "metadata key 'key': string length 1099511627776 exceeds the 5 bytes left");
  bytes = GgufBuilder().array("key", GgufType::kU32, std::vector<uint32_t>{1, 2}).build();
  patch_u64(bytes, 24 + 8 + 3 + 4 + 4, uint64_t{1} << 62);  // the array's length
  expect_error(bytes, ErrorKind::kCorruptFile, 43, "array length 4611686018427387904 exceeds");
  bytes = GgufBuilder().string_array("key", {"a", "b"}).build();
  patch_u64(bytes, 43, std::numeric_limits<uint64_t>::max() / 4);  // count * 8 would overflow
  expect_error(bytes, ErrorKind::kCorruptFile, 43, "array length");
}

TEST(GgufCorruptTest, BadValueTypes) {
  expect_error(
      GgufBuilder().kv("k", static_cast<GgufType>(13), [](ByteWriter& w) { w.pod(0); }).build(),
      ErrorKind::kCorruptFile, 24 + 9, "unknown value type 13");
  expect_error(
      GgufBuilder()
          .kv("k", GgufType::kArray, [](ByteWriter& w) { w.pod<uint32_t>(99), w.pod<uint64_t>(0); })
          .build(),
      ErrorKind::kCorruptFile, 24 + 13, "unknown array element type 99");
  expect_error(GgufBuilder().scalar("k", GgufType::kBool, uint8_t{2}).build(),
               ErrorKind::kCorruptFile, 24 + 13, "bool value 2");
  expect_error(GgufBuilder().array("k", GgufType::kBool, std::vector<uint8_t>{0, 1, 7}).build(),
               ErrorKind::kCorruptFile, 24 + 25 + 2, "bool array element 2 is 7");
}

// Arrays of arrays nest up to kGgufMaxArrayDepth.
Bytes nested_arrays(int depth) {
  return GgufBuilder()
      .kv("deep", GgufType::kArray,
          [&](ByteWriter& w) {
            for (int d = 1; d < depth; ++d) w.type(GgufType::kArray), w.pod<uint64_t>(1);
            w.type(GgufType::kU8);
            w.pod<uint64_t>(1);
            w.pod<uint8_t>(42);
          })
      .build();
}

TEST(GgufCorruptTest, ArrayNesting) {
  const GgufFile f = parse(nested_arrays(kGgufMaxArrayDepth));
  const GgufValue* v = f.find("deep");
  for (int d = 1; d < kGgufMaxArrayDepth; ++d) v = &v->arrays()[0];
  EXPECT_EQ(v->element(0).as_u8(), 42);
  expect_error(nested_arrays(kGgufMaxArrayDepth + 1), ErrorKind::kCorruptFile,
               24 + 8 + 4 + 4 + kGgufMaxArrayDepth * 12, "arrays nest deeper than 8");
}

TEST(GgufCorruptTest, DuplicateKeysAndTensors) {
  expect_error(GgufBuilder().string("k", "a").string("k", "b").build(), ErrorKind::kCorruptFile, 46,
               "metadata key 'k': duplicate key (first at offset 24)");
  expect_error(GgufBuilder()
                   .tensor(spec("t", DType::kF32, {1}, 1))
                   .tensor(spec("t", DType::kF32, {1}, 2))
                   .build(),
               ErrorKind::kCorruptFile, 24 + 33, "tensor 't': duplicate tensor name");
}

TEST(GgufCorruptTest, Alignment) {
  for (uint32_t alignment : {0u, 48u}) {
    expect_error(GgufBuilder().scalar("general.alignment", GgufType::kU32, alignment).build(),
                 ErrorKind::kCorruptFile, 24,
                 fmt::format("general.alignment {} is not a power of two", alignment));
  }
  expect_error(GgufBuilder().string("general.alignment", "32").build(), ErrorKind::kCorruptFile, 24,
               "general.alignment is string, expected a u32");
  // A u8 alignment is accepted.
  EXPECT_EQ(parse(GgufBuilder().scalar("general.alignment", GgufType::kU8, uint8_t{16}).build())
                .alignment(),
            16u);
}

// The first tensor info starts at 24: name at 24, n_dims at 33, ne[0] at 37.
TEST(GgufCorruptTest, TensorInfos) {
  auto one_tensor = [](TensorSpec t) { return GgufBuilder().tensor(std::move(t)).build(); };
  TensorSpec t = spec("t", DType::kF32, {4}, 1);
  t.ne = {1, 1, 1, 1, 1};
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 33,
               "tensor 't': 5 dimensions, expected 1 to 4");
  t.ne = {};
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 33, "0 dimensions");
  t.ne = {4, uint64_t{1} << 63};
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 45,
               "ne[1] is -9223372036854775808, negative");
  t.ne = {uint64_t{1} << 40, uint64_t{1} << 40};
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 45, "overflows int64 at ne[1]");
  t = spec("t", DType::kF32, {4}, 1);
  t.ne = {uint64_t{1} << 62};  // 2^62 f32s are 2^64 bytes
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 45, "overflows");
  t = spec("t", DType::kF32, {4}, 1);
  t.raw_type = 99;
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 45, "unknown ggml type 99");
  t.raw_type = 4;  // Q4_2, long removed
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 45, "unknown ggml type 4");
  t = spec("t", DType::kF32, {0, 4}, 1);  // zero-size tensors are allowed, as in llama.cpp
  EXPECT_EQ(parse(one_tensor(t)).tensor("t").n_bytes, 0u);
  t = spec("t", DType::kQ8_0, {64}, 1);
  t.ne = {33};
  expect_error(one_tensor(t), ErrorKind::kCorruptFile, 45,
               "ne[0] = 33 is not a multiple of the Q8_0 block size 32");
}

TEST(GgufCorruptTest, TensorData) {
  TensorSpec t = spec("t", DType::kF32, {4}, 1);
  t.offset = 8;
  expect_error(GgufBuilder().tensor(t).build(), ErrorKind::kCorruptFile, 49,
               "tensor 't': data offset 8 is not a multiple of the alignment 32");
  t = spec("t", DType::kF32, {4}, 1);
  t.data.resize(12);  // one element short: the file ends early
  expect_error(GgufBuilder().tensor(t).build(), ErrorKind::kCorruptFile, 49,
               "16 bytes at data offset 0 run past the end of the 12-byte data section");
  // Aligned, far past the end: offset + n_bytes must not wrap around.
  Bytes bytes = GgufBuilder().tensor(spec("t", DType::kF32, {4}, 1)).build();
  patch_u64(bytes, 49, std::numeric_limits<uint64_t>::max() - 31);
  expect_error(bytes, ErrorKind::kCorruptFile, 49, "run past the end");
  bytes = GgufBuilder().tensor(spec("t", DType::kF32, {4}, 1)).build();
  bytes.resize(57);  // the infos end at 57; the data section would start at 64
  expect_error(bytes, ErrorKind::kCorruptFile, 57, "the data section would start at offset 64");
}

}  // namespace
}  // namespace duet
