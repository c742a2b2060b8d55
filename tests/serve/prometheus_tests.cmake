# A real Prometheus server (Debian's `prometheus`, installed by launch/setup.sh)
# scrapes a single-process `duet serve` and a 1 prefill + 1 decode cluster, and
# the Grafana dashboard's queries are checked against what they scrape.
# Included from tests/CMakeLists.txt, which defines DUET_TEST_PYTHON.
add_test(NAME prometheus_scrape_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_prometheus.py)
set_tests_properties(prometheus_scrape_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS "serve;mpi"
  TIMEOUT 300)
