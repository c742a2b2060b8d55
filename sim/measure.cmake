# `duet profile`'s measurements (included from sim/CMakeLists.txt):
# engine steps timed and fitted (profile_measure.h), and KV transfers and the
# tensor-parallel all-reduce timed between two ranks (link_measure.h).
# A rig of ranks and the KV transfer phases timed on it, shared with
# duet-kv-transfer-bench (bench/kv_transfer_bench.cmake).
add_library(duet_kv_transfer_phases STATIC ${CMAKE_CURRENT_LIST_DIR}/link/rig.cpp
  ${CMAKE_CURRENT_LIST_DIR}/link/transfer_phases.cpp)
target_link_libraries(duet_kv_transfer_phases PUBLIC duet_transfer_mpi duet_worker
  PRIVATE spdlog::spdlog duet_warnings)
target_include_directories(duet_kv_transfer_phases PUBLIC ${PROJECT_SOURCE_DIR})

add_library(duet_sim_measure ${CMAKE_CURRENT_LIST_DIR}/profile_measure.cpp
  ${CMAKE_CURRENT_LIST_DIR}/link_measure.cpp)
target_link_libraries(duet_sim_measure PUBLIC duet_sim_profile duet_worker duet_control_plane
  PRIVATE duet_kv_transfer_phases duet_transfer_mpi duet_parallel_mpi spdlog::spdlog
  duet_warnings)
target_include_directories(duet_sim_measure PUBLIC ${PROJECT_SOURCE_DIR})
