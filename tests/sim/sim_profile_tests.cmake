# The cluster simulator's profiles: the step-cost fit, link costs, JSON, and
# the roofline profile of hardware not at hand.
duet_add_test(sim_profile_test SOURCES sim/sim_profile_test.cpp LIBS duet_sim_profile)
duet_add_test(sim_roofline_test SOURCES sim/sim_roofline_test.cpp LIBS duet_sim_profile)
