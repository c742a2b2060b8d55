# The control plane's tests (included from tests/CMakeLists.txt).
#
# Unit tests (no MPI initialized, milliseconds): the cluster spec, the control
# messages' wire form, MpiRuntime's refusal outside mpirun.
# mpirun tests (label `mpi`): control_plane_test, one scenario per run, on 3
# ranks (a coordinator and two leaders) with --oversubscribe, over each of
# the channel's links (MPI, TCP). The idle-CPU
# measurement idles 10 s and also carries the label `slow`; it still runs in CI.
duet_add_test(cluster_spec_test SOURCES common/cluster/cluster_spec_test.cpp LIBS duet_control)
duet_add_test(transfer_kind_test SOURCES worker/transfer/transfer_kind_test.cpp LIBS duet_transfer_kind)
duet_add_test(control_messages_test SOURCES common/cluster/control_messages_test.cpp LIBS duet_control)
duet_add_test(mpi_runtime_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/mpi_runtime_test.cpp LIBS duet_control_plane)

add_executable(control_plane_test ${CMAKE_CURRENT_LIST_DIR}/control_plane_main.cpp)
target_link_libraries(control_plane_test PRIVATE duet_control_plane CLI11::CLI11 duet_warnings)

set(DUET_MPIRUN ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
set(DUET_EXPECT_SAME_ERROR ${CMAKE_CURRENT_LIST_DIR}/expect_same_error.sh)

# name, ranks, timeout (s), labels, then the program's arguments.
function(duet_add_mpi_test name ranks timeout labels)
  add_test(NAME ${name}
    COMMAND ${DUET_MPIRUN} -np ${ranks} $<TARGET_FILE:control_plane_test> ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS "${labels}" TIMEOUT ${timeout})
endfunction()

duet_add_mpi_test(mpi_handshake 3 60 mpi --scenario handshake --prefill 1 --decode 1)
duet_add_mpi_test(mpi_handshake_colocated 3 60 mpi --scenario handshake --mode colocated
  --prefill 1 --decode 1)
# A TP=2 decode instance from a cluster file: its follower gets the verdict
# and closes with everyone; 4 ranks.
duet_add_mpi_test(mpi_roundtrip_tp2 4 300 mpi --scenario roundtrip
  --cluster ${CMAKE_CURRENT_LIST_DIR}/cluster_tp2.json --requests 1000)
duet_add_mpi_test(mpi_roundtrip 3 300 mpi --scenario roundtrip --prefill 1 --decode 1
  --requests 4000)
duet_add_mpi_test(mpi_shutdown 3 60 mpi --scenario shutdown --prefill 1 --decode 1)
duet_add_mpi_test(mpi_idle_cpu 3 90 "mpi;slow" --scenario idle --prefill 1 --decode 1
  --idle-seconds 10)
# The channel's own messages over its TCP link (--link tcp) instead of MPI:
# the same scenarios, and forget() with both links. Idle over TCP, the thread
# waits in poll() with no timeout: 0.006% of a core for all 3 ranks here
# (2.9% over MPI's back-off), so its limit is 2%.
duet_add_mpi_test(mpi_handshake_tcp 3 60 mpi --scenario handshake --prefill 1 --decode 1
  --link tcp)
duet_add_mpi_test(mpi_roundtrip_tp2_tcp 4 300 mpi --scenario roundtrip
  --cluster ${CMAKE_CURRENT_LIST_DIR}/cluster_tp2.json --requests 1000 --link tcp)
duet_add_mpi_test(mpi_roundtrip_tcp 3 300 mpi --scenario roundtrip --prefill 1 --decode 1
  --requests 4000 --link tcp)
duet_add_mpi_test(mpi_shutdown_tcp 3 60 mpi --scenario shutdown --prefill 1 --decode 1
  --link tcp)
duet_add_mpi_test(mpi_idle_cpu_tcp 3 90 "mpi;slow" --scenario idle --prefill 1 --decode 1
  --idle-seconds 10 --link tcp --idle-cpu-limit 0.02)
duet_add_mpi_test(mpi_forget 3 60 mpi --scenario forget --prefill 1 --decode 1)
duet_add_mpi_test(mpi_forget_tcp 3 60 mpi --scenario forget --prefill 1 --decode 1 --link tcp)
# A rank SIGKILLed over the TCP link (mpirun --enable-recovery keeps the job
# going): the coordinator hears of it at once and closes without it. Rank 0
# prints "lost: PASS" only when every check held; the survivors leave
# without MPI_Finalize, so mpirun's exit code says nothing.
add_test(NAME mpi_lost_tcp
  COMMAND ${DUET_MPIRUN} --enable-recovery -np 3 $<TARGET_FILE:control_plane_test>
    --scenario lost --prefill 1 --decode 1 --link tcp)
set_tests_properties(mpi_lost_tcp PROPERTIES LABELS mpi TIMEOUT 60
  PASS_REGULAR_EXPRESSION "lost: PASS" FAIL_REGULAR_EXPRESSION "\\] error:")

# Failures: every rank exits non-zero with the same line, and nothing hangs.
add_test(NAME mpi_version_mismatch
  COMMAND ${DUET_EXPECT_SAME_ERROR} 3
    "error: control handshake refused: rank 2, leader of instance 1 (decode), speaks control protocol version 99, the coordinator speaks version 7"
    60 ${DUET_MPIRUN} -np 3 $<TARGET_FILE:control_plane_test> --scenario handshake
    --prefill 1 --decode 1 --bad-version-rank 2)
add_test(NAME mpi_world_size_mismatch
  COMMAND ${DUET_EXPECT_SAME_ERROR} 3
    "error: cluster spec: the spec needs 4 processes (1 coordinator + 3 instance ranks) but mpirun started 3 (mpirun -np 4)"
    60 ${DUET_MPIRUN} -np 3 $<TARGET_FILE:control_plane_test> --scenario handshake
    --prefill 1 --decode 2)
add_test(NAME mpi_impossible_layout
  COMMAND ${DUET_EXPECT_SAME_ERROR} 3
    "error: cluster spec: rank 2 is in two instances: instance 0 (prefill) and instance 1 (decode)"
    60 ${DUET_MPIRUN} -np 3 $<TARGET_FILE:control_plane_test> --scenario handshake
    --cluster ${CMAKE_CURRENT_LIST_DIR}/cluster_overlap.json)
set_tests_properties(mpi_version_mismatch mpi_world_size_mismatch mpi_impossible_layout PROPERTIES
  LABELS mpi TIMEOUT 90)
# Without mpirun, cluster flags are refused before MPI is touched.
add_test(NAME mpi_refused_outside_mpirun
  COMMAND ${DUET_EXPECT_SAME_ERROR} 1 "was not started by mpirun" 30
    $<TARGET_FILE:control_plane_test> --scenario handshake --prefill 1 --decode 1)
set_tests_properties(mpi_refused_outside_mpirun PROPERTIES TIMEOUT 60)

# --device cuda on a machine without a GPU (or a build without CUDA): every
# instance refuses it at load and the coordinator ends the job with that one
# line. (On a machine with a GPU the cluster would serve instead.)
if(NOT EXISTS /dev/nvidia0)
  add_test(NAME mpi_serve_device_refused
    COMMAND ${DUET_EXPECT_SAME_ERROR} 1 "could not start: --device cuda:0 asked for a GPU"
      60 ${DUET_MPIRUN} -np 3 $<TARGET_FILE:duet> serve
      --model ${PROJECT_SOURCE_DIR}/tests/fixtures/tiny/tiny_q4_1_gqa_tied.gguf
      --prefill 1 --decode 1 --rpc-port 0 --http-port 0 --threads 1 --device cuda)
  set_tests_properties(mpi_serve_device_refused PROPERTIES LABELS mpi TIMEOUT 90)
  # The same for a tensor-parallel decode instance: both of its ranks refuse
  # before they would join an NCCL communicator, and nothing waits for them.
  add_test(NAME mpi_serve_tp_device_refused
    COMMAND ${DUET_EXPECT_SAME_ERROR} 1 "could not start: --device cuda:0 asked for a GPU"
      60 ${DUET_MPIRUN} -np 4 $<TARGET_FILE:duet> serve
      --model ${PROJECT_SOURCE_DIR}/tests/fixtures/tiny/tiny_q4_1_gqa_tied.gguf
      --prefill 1 --decode 1 --decode-tp 2 --rpc-port 0 --http-port 0 --threads 1 --device cuda)
  set_tests_properties(mpi_serve_tp_device_refused PROPERTIES LABELS mpi TIMEOUT 90)
endif()

# --kv-transport tcp carries CPU instances' KV only: with --device cuda every
# rank refuses it alike (unsupported) before any instance loads, GPU or not.
add_test(NAME mpi_serve_kv_transport_tcp_gpu_refused
  COMMAND ${DUET_EXPECT_SAME_ERROR} 3
    "duet: unsupported: --kv-transport tcp moves KV between CPU instances only"
    60 ${DUET_MPIRUN} -np 3 $<TARGET_FILE:duet> serve
    --model ${PROJECT_SOURCE_DIR}/tests/fixtures/tiny/tiny_q4_1_gqa_tied.gguf
    --prefill 1 --decode 1 --rpc-port 0 --http-port 0 --threads 1 --device cuda
    --kv-transport tcp)
set_tests_properties(mpi_serve_kv_transport_tcp_gpu_refused PROPERTIES LABELS mpi TIMEOUT 90)

# `duet serve` as a colocated cluster (coordinator + 2 instances) against the
# single-process server, end to end over HTTP; spec errors on every rank.
add_test(NAME mpi_serve_colocated_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_serve_colocated.py)
set_tests_properties(mpi_serve_colocated_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# `duet serve` disaggregated (coordinator + 1 prefill + 2 decode instances)
# against the single-process server: identical outputs, a 64-request burst,
# cancels in every phase, a prompt too big for any decode instance.
add_test(NAME mpi_serve_disaggregated_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_serve_disaggregated.py)
set_tests_properties(mpi_serve_disaggregated_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 900)
# The same over TcpKvTransfer (--kv-transport tcp) on loopback, without
# checksums, so that rows leave straight from the prefill instance's blocks.
add_test(NAME mpi_serve_disaggregated_tcp_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_serve_disaggregated.py)
set_tests_properties(mpi_serve_disaggregated_tcp_test PROPERTIES
  ENVIRONMENT "DUET_KV_TRANSPORT=tcp;DUET_KV_CHECKSUMS=off;DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 900)
# The same with the coordinator's control messages over the channel's TCP
# link (--control-transport tcp) on loopback, KV over MPI with every payload
# an MPI message (--kv-cma off; the first test reads them by cross-memory attach).
add_test(NAME mpi_serve_disaggregated_control_tcp_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_serve_disaggregated.py)
set_tests_properties(mpi_serve_disaggregated_control_tcp_test PROPERTIES
  ENVIRONMENT "DUET_CONTROL_TRANSPORT=tcp;DUET_KV_CMA=off;DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 900)
# `duet serve` with tensor-parallel instances (tests/mpi/test_serve_tp.py):
# colocated TP=2, and disaggregated TP=1 -> TP=3 and TP=3 -> TP=1 with the KV
# re-sharded rank to rank.
foreach(layout colocated 1to3 3to1)
  add_test(NAME mpi_serve_tp_${layout}_test
    COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_serve_tp.py)
  set_tests_properties(mpi_serve_tp_${layout}_test PROPERTIES
    ENVIRONMENT "DUET_TP_LAYOUT=${layout};DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
    LABELS mpi
    TIMEOUT 900)
endforeach()
# The KV re-sharded rank to rank over TcpKvTransfer (--kv-transport tcp).
foreach(layout 1to3 3to1)
  add_test(NAME mpi_serve_tp_${layout}_tcp_test
    COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_serve_tp.py)
  set_tests_properties(mpi_serve_tp_${layout}_tcp_test PROPERTIES
    ENVIRONMENT "DUET_KV_TRANSPORT=tcp;DUET_TP_LAYOUT=${layout};DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
    LABELS mpi
    TIMEOUT 900)
endforeach()
include(${CMAKE_CURRENT_LIST_DIR}/netns/netns_tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/tp_tests.cmake)

# MpiCollective (tensor-parallel collectives): two instances (TP 2 and TP 3)
# at once on 6 ranks; sums, bit-identical results on every rank, rank order.
add_executable(collective_test ${CMAKE_CURRENT_LIST_DIR}/collective_main.cpp)
target_link_libraries(collective_test PRIVATE duet_parallel_mpi duet_warnings)
add_test(NAME mpi_collective_test COMMAND ${DUET_MPIRUN} -np 6 $<TARGET_FILE:collective_test>)
set_tests_properties(mpi_collective_test PROPERTIES LABELS mpi TIMEOUT 120)

# Failure domains: can one mpirun job outlive one of its ranks? The probe
# SIGKILLs a rank in each phase of Duet's communication pattern (idle, KV
# payloads in flight both ways, a payload announced and never sent, an
# allreduce it never joins) and checks that the others go on, over shared
# memory and over TCP; and that without --enable-recovery the job ends.
add_executable(failure_probe ${CMAKE_CURRENT_LIST_DIR}/failure_probe_main.cpp)
target_link_libraries(failure_probe PRIVATE MPI::MPI_CXX Threads::Threads duet_warnings)
foreach(btl vader tcp)
  add_test(NAME mpi_failure_probe_${btl}
    COMMAND ${CMAKE_CURRENT_LIST_DIR}/failure_probe.sh $<TARGET_FILE:failure_probe> ${btl}
      ${DUET_MPIRUN})
  set_tests_properties(mpi_failure_probe_${btl} PROPERTIES LABELS mpi TIMEOUT 240)
endforeach()

# Failure domains end to end (tests/mpi/test_failover.py): under mpirun
# --enable-recovery, a decode rank SIGKILLed or SIGSTOPped while 12 streams
# run costs a pause and not one different token; both decode instances
# lost end the streams with `unavailable` and /health says 503.
add_test(NAME mpi_failover_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_failover.py)
set_tests_properties(mpi_failover_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# The same with the control channel over TCP (--control-transport tcp): a
# killed rank is lost by its connection's end; a stopped one, forgotten, has
# its socket closed and still leaves when it wakes.
add_test(NAME mpi_failover_control_tcp_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_failover.py)
set_tests_properties(mpi_failover_control_tcp_test PROPERTIES
  ENVIRONMENT "DUET_CONTROL_TRANSPORT=tcp;DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# Instances that join a running cluster and leave it (tests/mpi/test_join.py):
# bad joins refused with one line on both sides, a joined instance routed to
# and drained on SIGTERM with every stream whole and equal to `duet generate`,
# a killed one re-run from, and a join from an mpirun job of its own.
add_test(NAME mpi_join_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_join.py)
set_tests_properties(mpi_join_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# Prefill and decode instances that join a disaggregated cluster
# (tests/mpi/test_join_disaggregated.py): their KV links with every rank
# proving the cluster key, each replacing a killed or stopped rank of the job
# under load with every text equal to `duet generate`; a stopped prefill
# rank that wakes rejoins as a prefill member.
add_test(NAME mpi_join_disaggregated_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_join_disaggregated.py)
set_tests_properties(mpi_join_disaggregated_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# A rank of the mpirun job lost by silence that wakes rejoins through the
# join port as a member (tests/mpi/test_rank_rejoin.py): routed to again,
# every text equal to `duet generate`, every rank ending with exit code 0.
add_test(NAME mpi_rank_rejoin_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_rank_rejoin.py)
set_tests_properties(mpi_rank_rejoin_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 300)

# Instances that change role while serving (tests/mpi/test_role_change.py):
# `duet-client set-role` proves the cluster key; prefill, decode and
# colocated instances swap roles under load, every answer equal to
# `duet generate`, no block left held; refusals are one line.
add_test(NAME mpi_role_change_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_role_change.py)
set_tests_properties(mpi_role_change_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# Online rebalancing (tests/mpi/test_rebalance.py): bad --rebalance/--slo
# end the start with one line; bursts of long prompts over a TTFT target move
# one decode instance to prefill, every answer equal to `duet generate`.
add_test(NAME mpi_rebalance_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_rebalance.py)
set_tests_properties(mpi_rebalance_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# launch/local.sh keeps its instance count (tests/mpi/test_replacement.py): a
# colocated instance SIGKILLed mid-stream costs no token, and the launcher's
# replacement joins and serves; with --rebalance auto and DUET_MAX_EXTRA=1 a
# joined instance comes for the load and leaves once it is gone.
add_test(NAME mpi_replacement_test
  COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_replacement.py)
set_tests_properties(mpi_replacement_test PROPERTIES
  ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
  LABELS mpi
  TIMEOUT 600)

# Stopping a cluster with SIGTERM to mpirun (tests/mpi/test_drain.py): the
# streams in flight finish whole, new requests get 503 while it drains,
# /health/ready and /health/live tell the two apart, and every rank exits 0;
# with --drain-timeout 1 a long stream ends with an `unavailable` error event.
foreach(case drain drain_timeout)
  add_test(NAME mpi_${case}_test
    COMMAND ${DUET_TEST_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_drain.py DrainTest.test_${case})
  set_tests_properties(mpi_${case}_test PROPERTIES
    ENVIRONMENT "DUET_BINARY=$<TARGET_FILE:duet>;DUET_MODEL=${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf;DUET_MPIEXEC=${MPIEXEC_EXECUTABLE}"
    LABELS mpi
    TIMEOUT 90)
endforeach()
