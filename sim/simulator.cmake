# The cluster simulator (the real engine on a cost model, behind the real
# router), its planner, and `duet-sim`; included from this folder's CMakeLists.txt.
add_library(duet_sim
  ${CMAKE_CURRENT_LIST_DIR}/sim_instance.cpp
  ${CMAKE_CURRENT_LIST_DIR}/simulator.cpp
  ${CMAKE_CURRENT_LIST_DIR}/planner.cpp)
target_include_directories(duet_sim PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(duet_sim PUBLIC duet_sim_profile duet_coordinator duet_loadgen
  PRIVATE CLI11::CLI11 duet_warnings)
target_compile_definitions(duet_sim PRIVATE
  DUET_SIM_PLAN_PLOT_SCRIPT="${CMAKE_CURRENT_LIST_DIR}/plot_plan.py")

add_executable(duet-sim ${CMAKE_CURRENT_LIST_DIR}/duet_sim.cpp)
target_link_libraries(duet-sim PRIVATE duet_sim CLI11::CLI11 duet_warnings)
target_compile_definitions(duet-sim PRIVATE
  DUET_BENCH_PLOT_SCRIPT="${PROJECT_SOURCE_DIR}/bench/plot_bench.py")
