# `duet profile`'s measurement (sim/profile_measure.h) and the command
# itself (included from tests/CMakeLists.txt). The mpirun case (label `mpi`)
# runs `mpirun -np 2 duet profile` on a tiny model and reads back the
# transfers and the all-reduce it timed.
duet_add_test(sim_measure_test SOURCES sim/sim_measure_test.cpp
  LIBS duet_sim_measure nlohmann_json::nlohmann_json)
target_compile_definitions(sim_measure_test PRIVATE DUET_BINARY="$<TARGET_FILE:duet>")
add_dependencies(sim_measure_test duet)

duet_add_test(sim_measure_mpi_test SOURCES sim/sim_measure_mpi_test.cpp
  LIBS duet_sim_profile LABELS mpi)
target_compile_definitions(sim_measure_mpi_test PRIVATE DUET_BINARY="$<TARGET_FILE:duet>"
  DUET_MPIRUN="${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe")
add_dependencies(sim_measure_mpi_test duet)
