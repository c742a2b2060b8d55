// GGUF reader: round trips through an in-test writer (gguf_builder.h), every truncation, seeded
// byte mutations, and the real model files when they are present. One test per kind of
// corruption: gguf_corrupt_test.cpp.
#include "common/model/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>

#include "common/error.h"
#include "tests/common/model/gguf_builder.h"
#include "tests/test_paths.h"

namespace duet {
namespace {

using namespace gguf_testing;

constexpr uint64_t kBigU64 = (uint64_t{1} << 63) + 5;
constexpr int64_t kBigNegative = -(int64_t{1} << 62);

std::vector<TensorSpec> rich_tensors() {
  return {spec("f32", DType::kF32, {4, 3}, 1), spec("q8_0", DType::kQ8_0, {64, 2}, 2),
          spec("q4_1", DType::kQ4_1, {32}, 3), spec("f16", DType::kF16, {8, 2, 3}, 4),
          spec("i32", DType::kI32, {5}, 5),    spec("four dims", DType::kF32, {2, 1, 2, 1}, 6)};
}

// Every value type, nested arrays, alignment 64 and tensors of several types.
GgufBuilder rich_builder(uint32_t version = 3) {
  GgufBuilder b(version);
  b.scalar("u8", GgufType::kU8, uint8_t{200})
      .scalar("i8", GgufType::kI8, int8_t{-100})
      .scalar("u16", GgufType::kU16, uint16_t{60000})
      .scalar("i16", GgufType::kI16, int16_t{-30000})
      .scalar("u32", GgufType::kU32, uint32_t{4000000000})
      .scalar("i32", GgufType::kI32, int32_t{-2000000000})
      .scalar("f32", GgufType::kF32, 1.5f)
      .scalar("bool", GgufType::kBool, uint8_t{1})
      .string("string", "hello")
      .string("odd string", std::string("a\0\xff\xfe", 4))
      .string("empty string", "")
      .scalar("u64", GgufType::kU64, kBigU64)
      .scalar("i64", GgufType::kI64, kBigNegative)
      .scalar("f64", GgufType::kF64, 3.25)
      .alignment(64)
      .array("u32 array", GgufType::kU32, std::vector<uint32_t>{1, 2, 3})
      .array("big u32 array", GgufType::kU32, std::vector<uint32_t>{1, 4000000000})
      .array("i8 array", GgufType::kI8, std::vector<int8_t>{-1, 2})
      .array("f32 array", GgufType::kF32, std::vector<float>{0.5f, -2.0f})
      .array("f64 array", GgufType::kF64, std::vector<double>{0.25, 1e10})
      .array("bool array", GgufType::kBool, std::vector<uint8_t>{1, 0, 1})
      .array("empty i32 array", GgufType::kI32, std::vector<int32_t>{})
      .string_array("strings", {"a", "", "ccc"})
      .kv("nested", GgufType::kArray, [](ByteWriter& w) {  // [["x", "y"], [], ["z"]]
        w.type(GgufType::kArray);
        w.pod<uint64_t>(3);
        for (const std::vector<std::string>& inner :
             {std::vector<std::string>{"x", "y"}, std::vector<std::string>{},
              std::vector<std::string>{"z"}}) {
          w.type(GgufType::kString);
          w.pod<uint64_t>(inner.size());
          for (const auto& s : inner) w.str(s);
        }
      });
  for (TensorSpec& t : rich_tensors()) b.tensor(std::move(t));
  return b;
}

// ---------------------------------------------------------------------------------------------

void check_rich(const GgufFile& f, uint32_t version) {
  EXPECT_EQ(f.version(), version);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(f.name(), "test.gguf");

  EXPECT_EQ(f.find("u8")->as_u8(), 200);
  EXPECT_EQ(f.find("i8")->as_i8(), -100);
  EXPECT_EQ(f.find("u16")->as_u16(), 60000);
  EXPECT_EQ(f.find("i16")->as_i16(), -30000);
  EXPECT_EQ(f.find("u32")->as_u32(), 4000000000u);
  EXPECT_EQ(f.find("i32")->as_i32(), -2000000000);
  EXPECT_EQ(f.find("f32")->as_f32(), 1.5f);
  EXPECT_TRUE(f.find("bool")->as_bool());
  EXPECT_EQ(f.find("string")->as_string(), "hello");
  EXPECT_EQ(f.find("odd string")->as_string(), std::string("a\0\xff\xfe", 4));
  EXPECT_EQ(f.find("empty string")->as_string(), "");
  EXPECT_EQ(f.find("u64")->as_u64(), kBigU64);
  EXPECT_EQ(f.find("i64")->as_i64(), kBigNegative);
  EXPECT_EQ(f.find("f64")->as_f64(), 3.25);
  EXPECT_EQ(f.find("missing"), nullptr);

  // Integer conversions check the range.
  EXPECT_EQ(f.find("u8")->integer_as<int8_t>(), std::nullopt);
  EXPECT_EQ(f.find("u8")->integer_as<int32_t>(), 200);
  EXPECT_EQ(f.find("i32")->integer_as<uint32_t>(), std::nullopt);
  EXPECT_EQ(f.find("i64")->integer_as<int64_t>(), kBigNegative);
  EXPECT_EQ(f.find("u64")->integer_as<int64_t>(), std::nullopt);
  EXPECT_EQ(f.find("f32")->integer_as<int64_t>(), std::nullopt);
  EXPECT_THROW(f.find("u8")->as_i8(), Error);

  // Arrays.
  const GgufValue* u32s = f.find("u32 array");
  ASSERT_NE(u32s, nullptr);
  EXPECT_EQ(u32s->type(), GgufType::kArray);
  EXPECT_EQ(u32s->element_type(), GgufType::kU32);
  ASSERT_EQ(u32s->size(), 3u);
  EXPECT_EQ(u32s->element(2).as_u32(), 3u);
  EXPECT_EQ(u32s->element_bytes().size(), 12u);
  EXPECT_THROW(u32s->element(3), Error);
  EXPECT_EQ(f.find("i8 array")->element(0).as_i8(), -1);
  EXPECT_EQ(f.find("bool array")->element(1).as_bool(), false);
  EXPECT_EQ(f.find("f64 array")->element(1).as_f64(), 1e10);
  EXPECT_EQ(f.find("empty i32 array")->size(), 0u);
  EXPECT_EQ(f.find("strings")->strings(), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.find("strings")->element(2).as_string(), "ccc");
  const GgufValue* nested = f.find("nested");
  EXPECT_EQ(nested->element_type(), GgufType::kArray);
  ASSERT_EQ(nested->size(), 3u);
  EXPECT_EQ(nested->arrays()[0].strings(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(nested->arrays()[1].size(), 0u);
  EXPECT_EQ(nested->element(2).strings(), std::vector<std::string>{"z"});
  EXPECT_THROW(nested->strings(), Error);

  // Typed lookups: absent, accepted conversions, and wrong types (kCorruptFile).
  EXPECT_EQ(f.get_u32("missing"), std::nullopt);
  EXPECT_EQ(f.get_u32("u8"), 200u);
  EXPECT_EQ(f.get_u32("u32"), 4000000000u);
  EXPECT_EQ(f.get_u64("u64"), kBigU64);
  EXPECT_EQ(f.get_u64("u16"), 60000u);
  EXPECT_EQ(f.get_f32("f32"), 1.5f);
  EXPECT_EQ(f.get_f32("f64"), 3.25f);
  EXPECT_EQ(f.get_bool("bool"), true);
  EXPECT_EQ(f.get_string("string"), "hello");
  EXPECT_EQ(f.get_string_array("strings"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.get_i32_array("u32 array"), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(f.get_i32_array("i8 array"), (std::vector<int32_t>{-1, 2}));
  EXPECT_EQ(f.get_i32_array("empty i32 array"), std::vector<int32_t>{});
  EXPECT_EQ(f.get_f32_array("f32 array"), (std::vector<float>{0.5f, -2.0f}));
  EXPECT_EQ(f.get_f32_array("f64 array"), (std::vector<float>{0.25f, 1e10f}));
  for (const auto& bad : std::vector<std::function<void()>>{
           [&] { f.get_u32("i8"); }, [&] { f.get_u32("u64"); }, [&] { f.get_u32("string"); },
           [&] { f.get_u64("i64"); }, [&] { f.get_f32("u32"); }, [&] { f.get_bool("u8"); },
           [&] { f.get_string("u32"); }, [&] { f.get_string_array("u32 array"); },
           [&] { f.get_i32_array("big u32 array"); }, [&] { f.get_i32_array("strings"); },
           [&] { f.get_f32_array("u32 array"); }, [&] { f.get_string_array("nested"); }}) {
    const Error e = error_of(bad);
    EXPECT_EQ(e.kind(), ErrorKind::kCorruptFile);
    EXPECT_NE(std::string(e.what()).find("test.gguf: offset "), std::string::npos) << e.what();
  }

  // Keys in file order.
  ASSERT_EQ(f.metadata().size(), 24u);
  EXPECT_EQ(f.metadata()[0].key, "u8");
  EXPECT_EQ(f.metadata()[14].key, "general.alignment");
  EXPECT_EQ(f.metadata()[0].offset, 24u);

  // Tensors.
  const auto& tensors = f.tensors();
  ASSERT_EQ(tensors.size(), 6u);
  const std::vector<TensorSpec> expected = rich_tensors();
  uint64_t next_offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const GgufTensorInfo& t = tensors[i];
    SCOPED_TRACE(t.name);
    EXPECT_EQ(t.name, expected[i].name);
    EXPECT_EQ(static_cast<uint32_t>(t.type), expected[i].raw_type);
    ASSERT_EQ(t.ne.size(), expected[i].ne.size());
    for (size_t d = 0; d < t.ne.size(); ++d)
      EXPECT_EQ(static_cast<uint64_t>(t.ne[d]), expected[i].ne[d]);
    EXPECT_EQ(t.offset, next_offset);
    EXPECT_EQ(t.offset % 64, 0u);
    ASSERT_EQ(t.n_bytes, expected[i].data.size());
    EXPECT_EQ(std::memcmp(t.data, expected[i].data.data(), t.n_bytes), 0);
    EXPECT_EQ(t.data, tensors[0].data + t.offset);
    EXPECT_EQ(&f.tensor(t.name), &t);
    next_offset = (t.offset + t.n_bytes + 63) / 64 * 64;
  }
  EXPECT_EQ(tensors[3].n_elements(), 48);
  EXPECT_EQ(tensors[1].n_bytes, 2u * 2 * 34);  // Q8_0: 34 bytes per 32 elements
  EXPECT_EQ(tensors[2].n_bytes, 20u);          // Q4_1: 20 bytes per 32 elements
  EXPECT_EQ(f.data_offset() + tensors.back().offset + tensors.back().n_bytes, f.file_size());
  EXPECT_EQ(f.find_tensor("nope"), nullptr);
  const Error e = error_of([&] { f.tensor("nope"); });
  EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  EXPECT_EQ(std::string(e.what()), "test.gguf: no tensor named 'nope'");
}

TEST(GgufTest, RoundTripsEveryValueTypeVersion3) { check_rich(parse(rich_builder(3).build()), 3); }

TEST(GgufTest, RoundTripsEveryValueTypeVersion2) { check_rich(parse(rich_builder(2).build()), 2); }

TEST(GgufTest, DefaultAlignmentIs32) {
  const GgufFile f = parse(GgufBuilder()
                               .string("general.architecture", "llama")
                               .tensor(spec("a", DType::kF32, {3}, 1))
                               .tensor(spec("b", DType::kF32, {5}, 2))
                               .build());
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  EXPECT_EQ(f.tensor("b").offset, 32u);
}

TEST(GgufTest, EmptyFileWithoutTensorsParses) {
  const GgufFile f = parse(GgufBuilder().build());
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.file_size(), 24u);
}

TEST(GgufTest, MovesKeepDataPointers) {
  GgufFile a = parse(rich_builder().build());
  const uint8_t* data = a.tensor("q8_0").data;
  GgufFile b = std::move(a);
  EXPECT_EQ(b.tensor("q8_0").data, data);
  GgufFile c = parse(GgufBuilder().build());
  c = std::move(b);
  EXPECT_EQ(c.tensor("q8_0").data, data);
  check_rich(c, 3);
}

TEST(GgufTest, OpensFilesByMapping) {
  const Bytes bytes = rich_builder().build();
  const auto path =
      std::filesystem::temp_directory_path() / fmt::format("gguf_test_{}.gguf", ::getpid());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  {
    const GgufFile f = GgufFile::open(path);
    EXPECT_EQ(f.path(), path);
    EXPECT_EQ(f.file_size(), bytes.size());
    EXPECT_EQ(f.get_string("string"), "hello");
    EXPECT_EQ(std::memcmp(f.tensor("i32").data, spec("i32", DType::kI32, {5}, 5).data.data(), 20),
              0);
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc).flush();  // now empty
  EXPECT_EQ(error_of([&] { GgufFile::open(path); }).kind(), ErrorKind::kCorruptFile);
  std::filesystem::remove(path);
  const Error missing = error_of([&] { GgufFile::open(path); });
  EXPECT_EQ(missing.kind(), ErrorKind::kNotFound);
  EXPECT_EQ(std::string(missing.what()), path.string() + ": no such file");
  const Error directory = error_of([] { GgufFile::open(std::filesystem::temp_directory_path()); });
  EXPECT_EQ(directory.kind(), ErrorKind::kInvalidArgument);
}

// Every prefix of a file whose data section runs to its end is an error, never a crash.
TEST(GgufTest, EveryTruncationIsAnError) {
  const Bytes bytes = rich_builder().build();
  for (size_t n = 0; n < bytes.size(); ++n) {
    SCOPED_TRACE(fmt::format("prefix of {} bytes", n));
    const Error e = parse_error(Bytes(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(n)));
    ASSERT_EQ(e.kind(), ErrorKind::kCorruptFile) << e.what();
    ASSERT_NE(std::string(e.what()).find("test.gguf: offset "), std::string::npos) << e.what();
  }
}

// Random byte flips and hostile 64-bit values either parse (with every tensor inside the file)
// or throw a typed error; ASan/UBSan builds prove there is no out-of-bounds read.
TEST(GgufTest, MutationsNeverCrash) {
  const Bytes original = rich_builder().build();
  std::mt19937_64 rng(20240601);
  constexpr uint64_t kOne = 1;
  const uint64_t hostile[] = {0,          1,          63,         64,          kOne << 20,
                              0xFFFFFFFF, kOne << 62, kOne << 63, ~uint64_t{0}};
  int n_parsed = 0;
  for (int iteration = 0; iteration < 20000; ++iteration) {
    Bytes bytes = original;
    const int n_edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < n_edits; ++e) {
      const size_t at = rng() % bytes.size();
      if (rng() % 2 == 0 || at + 8 > bytes.size()) {
        bytes[at] = static_cast<uint8_t>(rng());
      } else {
        patch_u64(bytes, at, hostile[rng() % std::size(hostile)]);
      }
    }
    if (rng() % 8 == 0) bytes.resize(rng() % bytes.size());
    try {
      const GgufFile f = parse(bytes);
      ++n_parsed;
      for (const auto& t : f.tensors()) {
        ASSERT_LE(f.data_offset() + t.offset + t.n_bytes, f.file_size());
        volatile uint8_t sink = t.n_bytes > 0 ? t.data[t.n_bytes - 1] : 0;  // touch the last byte
        (void)sink;
      }
    } catch (const Error& e) {
      ASSERT_TRUE(e.kind() == ErrorKind::kCorruptFile || e.kind() == ErrorKind::kUnsupported)
          << e.what();
      ASSERT_NE(std::string(e.what()).find("offset "), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(n_parsed, 0);  // some edits land in tensor data or string bytes
}

// ---------------------------------------------------------------------------------------------
// Real files.

TEST(GgufModelTest, DefaultModel) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(path);
  const auto start = std::chrono::steady_clock::now();
  const GgufFile f = GgufFile::open(path);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("parsed %s in %.1f ms\n", path.c_str(), ms);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_u32("llama.block_count"), 30u);
  EXPECT_EQ(f.get_u32("llama.embedding_length"), 576u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->size(), 49152u);
  EXPECT_EQ(f.find("tokenizer.ggml.merges")->size(), 48900u);
  const GgufTensorInfo& embd = f.tensor("token_embd.weight");
  EXPECT_EQ(embd.type, DType::kQ8_0);
  EXPECT_EQ(embd.ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(embd.n_bytes, 576u / 32 * 34 * 49152);
  const GgufTensorInfo& down = f.tensor("blk.0.ffn_down.weight");
  EXPECT_EQ(down.type, DType::kQ4_1);
  EXPECT_EQ(down.ne, (std::vector<int64_t>{1536, 576}));
  EXPECT_EQ(f.data_offset() % f.alignment(), 0u);
}

TEST(GgufModelTest, Stories260K) {
  const auto path = testing::shared_model_path("stories260K.gguf");
  if (!path) GTEST_SKIP() << "stories260K.gguf not found in ../shared/models";
  const GgufFile f = GgufFile::open(*path);
  EXPECT_EQ(f.version(), 3u);
  for (const auto& t : f.tensors()) EXPECT_EQ(t.type, DType::kF32) << t.name;
  EXPECT_EQ(f.get_u32("llama.block_count"), 5u);
  EXPECT_EQ(f.get_u32("llama.embedding_length"), 64u);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->size(), 512u);
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores")->size(), 512u);
  EXPECT_EQ(f.get_i32_array("tokenizer.ggml.token_type")->size(), 512u);
}

}  // namespace
}  // namespace duet
