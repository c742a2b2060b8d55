# `duet profile`'s measurements (included from bench/sim/CMakeLists.txt):
# engine steps timed and fitted (profile_measure.h), and KV transfers and the
# tensor-parallel all-reduce timed between two ranks (link_measure.h).
add_library(duet_sim_measure ${CMAKE_CURRENT_LIST_DIR}/profile_measure.cpp
  ${CMAKE_CURRENT_LIST_DIR}/link_measure.cpp)
target_link_libraries(duet_sim_measure PUBLIC duet_sim_profile duet_worker duet_control_plane
  PRIVATE duet_kv_transfer_phases duet_transfer_mpi duet_parallel_mpi spdlog::spdlog
  duet_warnings)
target_include_directories(duet_sim_measure PUBLIC ${PROJECT_SOURCE_DIR})
