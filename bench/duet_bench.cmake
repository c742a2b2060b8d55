# duet-bench, the serving load generator (loadgen/), and its plot
# script; included from bench/CMakeLists.txt.
add_executable(duet-bench ${CMAKE_CURRENT_LIST_DIR}/duet_bench.cpp)
target_link_libraries(duet-bench PRIVATE duet_loadgen CLI11::CLI11 duet_warnings)
target_compile_definitions(duet-bench PRIVATE
  DUET_BENCH_CORPUS="${CMAKE_CURRENT_LIST_DIR}/data/corpus.txt"
  DUET_BENCH_PLOT_SCRIPT="${CMAKE_CURRENT_LIST_DIR}/plot_bench.py")
