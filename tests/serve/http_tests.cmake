# The OpenAI-compatible HTTP front end to end: each file starts the real
# `duet serve` and drives it with the `openai` package, curl and raw sockets.
# Included from tests/CMakeLists.txt, which defines DUET_TEST_PYTHON.
# CMAKE_CURRENT_LIST_DIR is this folder (CMAKE_CURRENT_SOURCE_DIR is the includer's).
foreach(name openai errors shutdown tokenize limits isolation)
  add_test(NAME http_${name}_test
    COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_http_${name}.py)
  set_tests_properties(http_${name}_test PROPERTIES
    ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    LABELS serve
    TIMEOUT 300)
endforeach()
