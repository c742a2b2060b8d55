# duet-bench's protocol clients (Cap'n Proto, over client/'s connection and
# calls; OpenAI-compatible HTTP), the runner and the reports, added to
# duet_loadgen; included from this folder's CMakeLists.txt.
target_sources(duet_loadgen PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/http_client.cpp
  ${CMAKE_CURRENT_LIST_DIR}/rpc_client.cpp
  ${CMAKE_CURRENT_LIST_DIR}/runner.cpp
  ${CMAKE_CURRENT_LIST_DIR}/report.cpp)
target_link_libraries(duet_loadgen PUBLIC duet_rpc_client Boost::system nlohmann_json::nlohmann_json)
