# DUET_CUDA=AUTO|ON|OFF. AUTO builds the CUDA backend when nvcc is found; ON
# fails without it; OFF never looks. A CPU-only build always works, and a
# CUDA build still starts on a machine without a GPU.
set(DUET_HAVE_CUDA OFF)
if(NOT DUET_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Must precede enable_language(CUDA), or CMake falls back to sm_75.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    # CMake 3.25 knows no C++20 dialect flag for nvcc; nvcc 13 takes -std=c++20.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION -std=c++20)
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION -std=c++20)
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)               # CUDA::cudart, CUDA::cublas
    # NCCL: the toolkit's or the system's, else a Python wheel's (nvidia-nccl-cu*
    # installs nvidia/nccl/lib/libnccl.so.2, never libnccl.so, and not always
    # nccl.h); -DNCCL_LIBRARY and -DNCCL_INCLUDE_DIR override the search. A
    # library without a header compiles against the vendored header of NCCL
    # 2.28.9 (third_party/nccl), not a run-time dlopen: the NCCL calls in
    # kernels/ and worker/ stay plain calls, and the NCCL 2 entry points Duet
    # uses are the same in every libnccl.so.2.
    find_program(DUET_PYTHON3 python3)
    mark_as_advanced(DUET_PYTHON3)
    set(nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
    set(nccl_library_hints ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
    if(DUET_PYTHON3)
      execute_process(
        COMMAND ${DUET_PYTHON3} -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
        OUTPUT_VARIABLE nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET TIMEOUT 10)
      if(nccl_wheel)
        list(APPEND nccl_include_hints ${nccl_wheel}/include)
        list(APPEND nccl_library_hints ${nccl_wheel}/lib)
      endif()
    endif()
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${nccl_include_hints})
    find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${nccl_library_hints})
    if(NOT NCCL_LIBRARY)
      message(FATAL_ERROR "nvcc found but no NCCL library (libnccl.so or libnccl.so.2; "
        "-DNCCL_LIBRARY=PATH names one)")
    endif()
    if(NOT NCCL_INCLUDE_DIR)
      set(NCCL_INCLUDE_DIR ${PROJECT_SOURCE_DIR}/third_party/nccl/include CACHE PATH
        "Folder of nccl.h" FORCE)
      message(STATUS "NCCL: ${NCCL_LIBRARY} without nccl.h: the vendored NCCL 2.28.9 header")
    endif()
    add_library(duet::nccl SHARED IMPORTED)
    set_target_properties(duet::nccl PROPERTIES
      IMPORTED_LOCATION ${NCCL_LIBRARY}
      INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
    set(DUET_HAVE_CUDA ON)
  elseif(DUET_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DUET_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "Duet CUDA backend: ${DUET_HAVE_CUDA}")
