# The cluster simulator and its planner (no model, no MPI: milliseconds to seconds).
duet_add_test(sim_test SOURCES bench/sim_test.cpp LIBS duet_sim)
