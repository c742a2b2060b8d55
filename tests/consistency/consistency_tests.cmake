# Every door against the single-prompt path (included from tests/CMakeLists.txt):
# test_doors.py compares the token ids of `duet generate --prompt` with those of
# `--prompts-file`, `duet serve` over HTTP and Cap'n Proto, a disaggregated
# cluster and a TP=2 instance under mpirun, for tests/consistency/prompts.json,
# greedy and seeded-sampled. Skipped (exit 77) without the default model.
add_test(NAME consistency_doors_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_doors.py)
set_tests_properties(consistency_doors_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS "consistency;mpi"
  SKIP_RETURN_CODE 77
  TIMEOUT 300)

# The same doors for each model family Duet added to Llama's, on its tiny
# fixture (text prompts only: the fixtures carry no chat template). gemma3's
# window of 8 is crossed by every prompt but the shortest; the mixtures of
# experts add the door of a disaggregated cluster whose two sides split the
# experts differently.
foreach(fixture qwen3_gqa_tied gemma3_swa_tied qwen3moe_tied mixtral_untied)
  string(REGEX REPLACE "_.*" "" name ${fixture})
  set(expert_parallel 0)
  if(name MATCHES "moe|mixtral")
    set(expert_parallel 1)
  endif()
  add_test(NAME consistency_${name}_doors_test
    COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_doors.py)
  set_tests_properties(consistency_${name}_doors_test PROPERTIES
    ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/tests/fixtures/tiny_shapes/tiny_${fixture}.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE};DUET_CONSISTENCY_PROMPTS=${CMAKE_CURRENT_LIST_DIR}/family_prompts.json;DUET_EXPERT_PARALLEL=${expert_parallel}"
    LABELS "consistency;mpi"
    SKIP_RETURN_CODE 77
    TIMEOUT 300)
endforeach()
