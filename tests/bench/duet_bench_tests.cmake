# duet-bench end to end against the real `duet serve` (Cap'n Proto and HTTP,
# open and closed loop, a replayed trace). Included from tests/CMakeLists.txt,
# which defines DUET_TEST_PYTHON.
add_test(NAME duet_bench_e2e_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/duet_bench_e2e.py)
set_tests_properties(duet_bench_e2e_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_BENCH=$<TARGET_FILE:duet-bench>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  LABELS serve
  TIMEOUT 300)

# duet-logits (bench/greedy_margins.py's Duet side) along llama.cpp's greedy
# decode of the tiny models (tests/golden/tiny_models.json).
add_test(NAME duet_logits_test
  COMMAND ${DUET_TEST_PYTHON} -S ${CMAKE_CURRENT_LIST_DIR}/test_duet_logits.py)
set_tests_properties(duet_logits_test PROPERTIES
  ENVIRONMENT "DUET_LOGITS=$<TARGET_FILE:duet-logits>"
  TIMEOUT 300)
