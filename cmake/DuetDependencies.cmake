# Every third-party dependency of the project, found once here so that later
# layers only link targets. All come from Debian packages (launch/setup.sh).
find_package(Threads REQUIRED)
# The CUDA-only build (DUET_CUDA_ONLY) needs no other library.
if(DUET_CUDA_ONLY)
  return()
endif()
include(FindPkgConfig)

set(MPI_CXX_SKIP_MPICXX ON)
find_package(MPI REQUIRED COMPONENTS CXX)            # MPI::MPI_CXX
find_package(CapnProto CONFIG REQUIRED)              # CapnProto::capnp-rpc, capnp_generate_cpp
find_package(Boost 1.74 REQUIRED COMPONENTS system)  # Boost::system, Asio/Beast headers
find_package(spdlog CONFIG REQUIRED)                 # spdlog::spdlog
find_package(fmt CONFIG REQUIRED)                    # fmt::fmt
find_package(nlohmann_json CONFIG REQUIRED)          # nlohmann_json::nlohmann_json
find_package(CLI11 CONFIG REQUIRED)                  # CLI11::CLI11
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)  # PkgConfig::PCRE2
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)                          # BLAS::BLAS (reference GEMM in tests)
if(DUET_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)                # GTest::gtest_main
  include(GoogleTest)
  find_package(benchmark CONFIG REQUIRED)            # benchmark::benchmark
endif()
