# The Cap'n Proto front's tests (included from tests/CMakeLists.txt).
#
# rpc_test, rpc_limits_test: GoogleTest, the real classes in one process over
# loopback sockets (their fixture: rpc_fixture.h).
# pycapnp_client: the real `duet serve` driven by Python's pycapnp.
# rpc_client_cli: the real `duet serve` driven by `duet-client`.
# The model-driven ones skip, saying why, without the default model.
duet_add_test(rpc_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/rpc_test.cpp
  LIBS duet_rpc_front duet_worker LABELS serve)
duet_add_test(rpc_limits_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/rpc_limits_test.cpp
  LIBS duet_rpc_front duet_worker LABELS serve)

set(DUET_RPC_TEST_MODEL ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf)
add_test(NAME pycapnp_client
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_pycapnp.py -v)
set_tests_properties(pycapnp_client PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${DUET_RPC_TEST_MODEL}"
  LABELS serve TIMEOUT 300)

add_test(NAME rpc_client_cli
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_client_cli.py -v)
set_tests_properties(rpc_client_cli PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_CLIENT=$<TARGET_FILE:duet-client>;DUET_MODEL=${DUET_RPC_TEST_MODEL}"
  LABELS serve TIMEOUT 300)
