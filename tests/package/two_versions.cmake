# SPDX-License-Identifier: Apache-2.0
#! @file tests/package/two_versions.cmake  ctest driver (cmake -P) of the two-version test: two shared
#! libraries built from prox copies of different versions, plus one of the same version with different
#! code, load into one process without sharing prox's host symbols.
#!   -DPROX_INCLUDE_DIR=<prox>/include  -DWORK_DIR=<scratch>  [-DGENERATOR=Ninja]
#! Each copy of include/ gets its version.hpp patched here, at test time; the repository holds one copy.
cmake_minimum_required(VERSION 3.22)  # policies of script mode
foreach(v PROX_INCLUDE_DIR WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "two_versions: -D${v}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# Two versions that differ in the patch number only: the closest two releases can be.
set(version_a 7.3.1)
set(version_b 7.3.2)
foreach(copy a b)
  set(version ${version_${copy}})
  string(REPLACE "." ";" parts ${version})
  list(GET parts 0 major)
  list(GET parts 1 minor)
  list(GET parts 2 patch)
  file(COPY ${PROX_INCLUDE_DIR}/prox DESTINATION ${WORK_DIR}/include_${copy})
  set(header ${WORK_DIR}/include_${copy}/prox/version.hpp)
  file(READ ${header} text)
  set(patched "${text}")
  string(REGEX REPLACE "#define PROX_VERSION_MAJOR [0-9]+" "#define PROX_VERSION_MAJOR ${major}" patched "${patched}")
  string(REGEX REPLACE "#define PROX_VERSION_MINOR [0-9]+" "#define PROX_VERSION_MINOR ${minor}" patched "${patched}")
  string(REGEX REPLACE "#define PROX_VERSION_PATCH [0-9]+" "#define PROX_VERSION_PATCH ${patch}" patched "${patched}")
  string(REGEX REPLACE "#define PROX_VERSION_STRING \"[0-9.]+\"" "#define PROX_VERSION_STRING \"${version}\""
         patched "${patched}")
  foreach(line "PROX_VERSION_MAJOR ${major}" "PROX_VERSION_MINOR ${minor}" "PROX_VERSION_PATCH ${patch}"
               "PROX_VERSION_STRING \"${version}\"")
    string(FIND "${patched}" "#define ${line}\n" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "two_versions: could not patch '#define ${line}' into ${header}")
    endif()
  endforeach()
  file(WRITE ${header} "${patched}")
endforeach()

if(NOT GENERATOR)
  set(GENERATOR Ninja)
endif()
get_filename_component(project_dir ${CMAKE_CURRENT_LIST_DIR}/two_versions ABSOLUTE)
execute_process(COMMAND ${CMAKE_COMMAND} -S ${project_dir} -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DPROX_INCLUDE_A=${WORK_DIR}/include_a -DPROX_INCLUDE_B=${WORK_DIR}/include_b
                        -DPROX_VERSION_A=${version_a} -DPROX_VERSION_B=${version_b}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "two_versions: configure failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "two_versions: build failed")
endif()

# 1. At run time: each module returns its own version and its own statics.
execute_process(COMMAND ${WORK_DIR}/build/two_versions RESULT_VARIABLE run_rc)

# 2. In the binaries: no module exports a prox symbol (nm -D lists the dynamic symbol table).
find_program(NM nm)
if(NOT NM)
  message(FATAL_ERROR "two_versions: nm (binutils) not found")
endif()
set(exported 0)
foreach(m mod_a mod_b mod_c)
  execute_process(COMMAND ${NM} -D -C --defined-only ${WORK_DIR}/build/lib${m}.so OUTPUT_VARIABLE syms
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "two_versions: nm -D lib${m}.so failed")
  endif()
  string(REGEX MATCHALL "[^\n]*prox::[^\n]*" prox_syms "${syms}")
  list(LENGTH prox_syms n)
  if(n GREATER 0)
    list(JOIN prox_syms "\n  " listing)
    message(STATUS "FAIL lib${m}.so exports ${n} prox symbols:\n  ${listing}")
    math(EXPR exported "${exported} + ${n}")
  else()
    message(STATUS "ok   lib${m}.so exports no prox symbol")
  endif()
endforeach()
if(run_rc OR exported)
  message(FATAL_ERROR "two_versions: modules share prox entities (run: exit ${run_rc}; exported prox symbols: ${exported})")
endif()
