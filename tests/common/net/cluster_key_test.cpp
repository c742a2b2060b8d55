// The cluster key (common/net/cluster_auth.h): HMAC-SHA256 against RFC 4231,
// its fingerprint, and key files (mode, length, whitespace, a missing file).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/net/cluster_auth.h"
#include "tests/common/net/byte_text.h"

namespace duet {
namespace {

const std::string kKeyA = "0123456789abcdef0123456789abcdef";
const std::string kKeyB = "fedcba9876543210fedcba9876543210";

TEST(ClusterKey, SignsAsRfc4231) {
  // RFC 4231 test cases 6 and 7: a 131-byte key.
  const ClusterKey key = ClusterKey::from_bytes(std::string(131, '\xaa'));
  EXPECT_EQ(hex_of(key.sign(bytes_of("Test Using Larger Than Block-Size Key - Hash Key First"))),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(hex_of(key.sign(bytes_of(
                "This is a test using a larger than block-size key and a larger than block-size "
                "data. The key needs to be hashed before being used by the HMAC algorithm."))),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST(ClusterKey, FingerprintIsTheStartOfSha256) {
  // printf 0123456789abcdef0123456789abcdef | sha256sum
  EXPECT_EQ(ClusterKey::from_bytes(kKeyA).fingerprint(), "3eb1bd439947eb76");
  EXPECT_NE(ClusterKey::from_bytes(kKeyB).fingerprint(), "3eb1bd439947eb76");
}

TEST(ClusterKey, FromBytesNeeds32) {
  try {
    ClusterKey::from_bytes(std::string(31, 'k'));
    FAIL() << "a 31-byte key was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
}

class ClusterKeyFile : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("cluster_auth_test." + std::to_string(getpid()) + "." +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A file holding `content` with `mode` (whatever the umask).
  std::string write(const std::string& name, std::string_view content, mode_t mode) {
    const std::string path = (dir_ / name).string();
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(write_all_of(fd, content), content.size());
    EXPECT_EQ(fchmod(fd, mode), 0);
    close(fd);
    return path;
  }

  // The error from_file(path) throws.
  static Error error_from(const std::string& path) {
    try {
      ClusterKey::from_file(path);
    } catch (const Error& e) {
      return e;
    }
    return Error(ErrorKind::kInternal, "(no error)");
  }

 private:
  static size_t write_all_of(int fd, std::string_view content) {
    return static_cast<size_t>(::write(fd, content.data(), content.size()));
  }

  std::filesystem::path dir_;
};

TEST_F(ClusterKeyFile, ReadsAndTrimsWhitespace) {
  const ClusterKey plain = ClusterKey::from_bytes(kKeyA);
  const std::vector<std::byte> message = bytes_of("join");
  const ClusterKey bare = ClusterKey::from_file(write("bare", kKeyA, 0600));
  const ClusterKey padded = ClusterKey::from_file(write("padded", " \t" + kKeyA + "\r\n\n", 0400));
  EXPECT_EQ(bare.sign(message), plain.sign(message));
  EXPECT_EQ(padded.sign(message), plain.sign(message));
  EXPECT_EQ(padded.fingerprint(), plain.fingerprint());
}

TEST_F(ClusterKeyFile, TooShort) {
  // 31 bytes, and a newline that does not count.
  const std::string path = write("short", kKeyA.substr(0, 31) + "\n", 0600);
  const Error e = error_from(path);
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  const std::string what = e.what();
  EXPECT_EQ(what.rfind("cluster key " + path + ": ", 0), 0u) << what;
  EXPECT_NE(what.find("head -c 32 /dev/urandom | base64 > " + path), std::string::npos) << what;
}

TEST_F(ClusterKeyFile, ReadableByOthers) {
  for (const mode_t mode : {0644, 0640, 0604}) {
    const std::string path = write("open", kKeyA, mode);
    const Error e = error_from(path);
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << mode;
    EXPECT_EQ(std::string(e.what()),
              "cluster key " + path + ": is readable by others (chmod 600 " + path + ")");
  }
  const std::string path = write("writable", kKeyA, 0620);
  EXPECT_NE(std::string(error_from(path).what()).find("writable by others"), std::string::npos);
}

TEST_F(ClusterKeyFile, Missing) {
  const std::string path = write("present", kKeyA, 0600) + ".missing";
  const Error e = error_from(path);
  EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  EXPECT_EQ(std::string(e.what()).rfind("cluster key " + path + ": ", 0), 0u) << e.what();
}

}  // namespace
}  // namespace duet
