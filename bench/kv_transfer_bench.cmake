# duet-kv-transfer-bench: raw MPI point-to-point against MpiKvTransfer at the
# KV message size, and (with --model) the TTFT a transfer adds; included from
# bench/CMakeLists.txt. Its smoke run (label `mpi`, no model) passes only when
# every transferred KV equals what was sent.
#
# Its rig and transfer phases are sim/link/'s (duet_kv_transfer_phases): `duet
# profile` times transfers with them too.
add_executable(duet-kv-transfer-bench ${CMAKE_CURRENT_LIST_DIR}/kv_transfer_bench.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_transfer/ttft_phase.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_transfer/report.cpp)
target_link_libraries(duet-kv-transfer-bench PRIVATE duet_kv_transfer_phases duet_transfer_mpi
  duet_worker CLI11::CLI11 spdlog::spdlog nlohmann_json::nlohmann_json duet_warnings)
target_include_directories(duet-kv-transfer-bench PRIVATE ${PROJECT_SOURCE_DIR})

add_test(NAME kv_transfer_bench_smoke
  COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe -np 3
    $<TARGET_FILE:duet-kv-transfer-bench> --reps 2 --tokens 64)
set_tests_properties(kv_transfer_bench_smoke PROPERTIES LABELS mpi TIMEOUT 60)
