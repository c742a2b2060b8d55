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
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
      message(FATAL_ERROR "nvcc found but NCCL is missing (nccl.h / libnccl)")
    endif()
    add_library(duet::nccl UNKNOWN IMPORTED)
    set_target_properties(duet::nccl PROPERTIES
      IMPORTED_LOCATION ${NCCL_LIBRARY}
      INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
    set(DUET_HAVE_CUDA ON)
  elseif(DUET_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DUET_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "Duet CUDA backend: ${DUET_HAVE_CUDA}")
