# duet-bench's load generator: statistics and prompts; workloads (arrivals,
# lengths, traces, mixes).
duet_add_test(loadgen_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/loadgen_test.cpp LIBS duet_loadgen)
duet_add_test(workload_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/workload_test.cpp LIBS duet_loadgen)
