# SPDX-License-Identifier: Apache-2.0
#! @file bench/tune.cmake  The `prox-tune` command (bench/prox_tune.cu): tunes prox's candidate
#! policies on this GPU and writes the tuning cache (docs/tuning.md). Included by bench/CMakeLists.txt.
find_package(fmt REQUIRED)  # Debian libfmt-dev 9
find_package(CUDAToolkit REQUIRED)

add_executable(prox-tune ${CMAKE_CURRENT_LIST_DIR}/prox_tune.cu)
target_link_libraries(prox-tune PRIVATE prox::prox prox_support fmt::fmt CUDA::cudart)
if(TARGET prox_warnings)
  target_link_libraries(prox-tune PRIVATE prox_warnings)
endif()
