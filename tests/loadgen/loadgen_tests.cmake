# duet-bench's load generator: statistics, arrivals, lengths, traces, prompts.
duet_add_test(loadgen_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/loadgen_test.cpp LIBS duet_loadgen)
