# duet-tp-step-bench: the decode step latency of one tensor-parallel instance
# (every rank of `mpirun -np T` one rank of it), with the share spent in
# collectives and the bytes they move; included from bench/CMakeLists.txt.
# Its smoke run (label `mpi`, TP=2, a few tiny steps) is skipped (exit 77)
# without the default model.
add_executable(duet-tp-step-bench ${CMAKE_CURRENT_LIST_DIR}/tp_step_bench.cpp)
target_link_libraries(duet-tp-step-bench PRIVATE duet_worker duet_parallel_mpi CLI11::CLI11
  nlohmann_json::nlohmann_json duet_warnings)

set(DUET_TP_BENCH_MODEL ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf)
add_test(NAME tp_step_bench_smoke
  COMMAND sh -c "test -f \"$1\" || { echo \"skipped: $1 not found (run launch/setup.sh)\"\n exit 77\n }\n shift\n exec \"$@\""
    tp_step_bench_smoke ${DUET_TP_BENCH_MODEL}
    ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe -np 2
    $<TARGET_FILE:duet-tp-step-bench> --model ${DUET_TP_BENCH_MODEL} --threads 1 --batch 2
    --context 16 --steps 3 --warmup 1)
set_tests_properties(tp_step_bench_smoke PROPERTIES LABELS mpi TIMEOUT 120 SKIP_RETURN_CODE 77)
