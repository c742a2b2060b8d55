# The cluster simulator and its planner (no model, no MPI: milliseconds to seconds).
duet_add_test(sim_test SOURCES sim/sim_test.cpp LIBS duet_sim)
# The simulator's instance and LocalInstance: one core, the same events.
duet_add_test(instance_twins_test SOURCES sim/instance_twins_test.cpp
  LIBS duet_sim duet_transfer_tcp)

# duet-sim as a user runs it, on a roofline profile `duet profile` writes.
add_test(NAME duet_sim_cli_test
  COMMAND ${DUET_TEST_PYTHON} -S ${CMAKE_CURRENT_SOURCE_DIR}/sim/duet_sim_cli_test.py
    $<TARGET_FILE:duet> $<TARGET_FILE:duet-sim> ${PROJECT_SOURCE_DIR}/bench/traces/chat_80.csv)
