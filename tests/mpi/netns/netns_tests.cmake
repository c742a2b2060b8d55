# A cluster across three hosts that are network namespaces on this machine,
# joined by veth pairs on a bridge (netns_serve_test.sh): launch/hostfile.sh
# starts `duet serve` with mpirun reaching the hosts through netns_agent.sh,
# MPI over TCP only; greedy answers must equal the single process's and the
# bytes must really cross the veths. Needs root: skipped (exit 77) without
# it or where network namespaces are not permitted. Included from
# tests/mpi/mpi_tests.cmake.
#
# The arguments after the script are duet serve's (the cluster's mode).
add_test(NAME mpi_serve_netns_test
  COMMAND ${CMAKE_CURRENT_LIST_DIR}/netns_serve_test.sh)
set_tests_properties(mpi_serve_netns_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIRUN=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  SKIP_RETURN_CODE 77
  TIMEOUT 300)

# A decode rank on another host SIGKILLed while a prompt's KV flows to it
# (netns_failover_test.sh, four hosts): every stream ends with the single
# process's text, over Duet's own TCP KV connections. Needs root, as above.
add_test(NAME mpi_netns_failover_test
  COMMAND ${CMAKE_CURRENT_LIST_DIR}/netns_failover_test.sh)
set_tests_properties(mpi_netns_failover_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIRUN=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  SKIP_RETURN_CODE 77
  TIMEOUT 90)

# A lost decode instance replaced across hosts (netns_failover_test.sh with
# DUET_NETNS_REPLACE=1, three hosts, 1P+1D): the launcher starts a decode
# replacement on the victim's host, which joins and links its KV with the
# prefill rank over TCP; every stream waits for it and ends with the single
# process's text, and /health is ok again. Needs root, as above.
add_test(NAME mpi_netns_replacement_test
  COMMAND ${CMAKE_CURRENT_LIST_DIR}/netns_failover_test.sh)
set_tests_properties(mpi_netns_replacement_test PROPERTIES
  ENVIRONMENT "DUET_NETNS_REPLACE=1;DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIRUN=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  SKIP_RETURN_CODE 77
  TIMEOUT 180)

# The same beside two busy processes (tests/mpi/under_load.sh), under
# ctest -j2 beside other tests: a loaded machine may delay a healthy rank's
# heartbeats past the 1 s lease, which must make it suspect, never lost
# (coordinator/cluster/liveness.h); the test checks that only rank 2's
# instance was lost.
add_test(NAME mpi_netns_failover_under_load_test
  COMMAND ${PROJECT_SOURCE_DIR}/tests/mpi/under_load.sh 2
          ${CMAKE_CURRENT_LIST_DIR}/netns_failover_test.sh)
set_tests_properties(mpi_netns_failover_under_load_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIRUN=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  SKIP_RETURN_CODE 77
  TIMEOUT 180)
