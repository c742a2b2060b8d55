# Tensor parallelism end to end on the default model (included from
# tests/mpi/mpi_tests.cmake): mpi_tp_forward_test runs TP=1 (rank 0), TP=2
# (ranks 1-2, the uneven 2 + 1 KV-head split) and TP=3 (ranks 3-5) at once
# and compares their logits, greedy paths, per-rank bit-identity and owned
# weight bytes (tests/mpi/tp_forward_main.cpp). Skipped (exit 77) without the
# model.
add_executable(tp_forward_test ${CMAKE_CURRENT_LIST_DIR}/tp_forward_main.cpp)
target_link_libraries(tp_forward_test PRIVATE duet_worker duet_parallel_mpi duet_warnings)
target_compile_definitions(tp_forward_test PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_test(NAME mpi_tp_forward_test COMMAND ${DUET_MPIRUN} -np 6 $<TARGET_FILE:tp_forward_test>)
set_tests_properties(mpi_tp_forward_test PROPERTIES LABELS mpi TIMEOUT 300 SKIP_RETURN_CODE 77)

# Expert parallelism on the tiny mixture-of-experts fixtures: the whole model
# (rank 0) and EP=2 (ranks 1-2) give the same logits bit for bit, in one
# prefill and in chunks then decode steps (tests/mpi/ep_forward_main.cpp).
add_executable(ep_forward_test ${CMAKE_CURRENT_LIST_DIR}/ep_forward_main.cpp)
target_link_libraries(ep_forward_test PRIVATE duet_worker duet_parallel_mpi nlohmann_json::nlohmann_json duet_warnings)
target_compile_definitions(ep_forward_test PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_test(NAME mpi_ep_forward_test COMMAND ${DUET_MPIRUN} -np 3 $<TARGET_FILE:ep_forward_test>)
set_tests_properties(mpi_ep_forward_test PROPERTIES LABELS mpi TIMEOUT 120)
