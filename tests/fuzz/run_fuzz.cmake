# Builds tests/fuzz with clang and runs each fuzz target for SECONDS seconds over its seed
# corpus. A crash input is left in WORK_DIR (crash-*) and fails the test; commit it to the
# corpus as a regression input once fixed. -DSOURCE_DIR -DWORK_DIR -DTorch_DIR -DSECONDS -DPREFIX_PATH
find_program(CLANGXX NAMES clang++ clang++-14 clang++-15 clang++-16)
if(NOT CLANGXX)
  message("SKIPPED: clang++ not found (./scripts/setup.sh installs clang and libclang-rt-14-dev)")
  return()
endif()
file(MAKE_DIRECTORY "${WORK_DIR}")
string(REPLACE ";" "\\;" _prefix_arg "${PREFIX_PATH}")
include(${CMAKE_CURRENT_LIST_DIR}/../nested_generator.cmake)
torchdbg_reset_if_other_generator("${WORK_DIR}/build")
execute_process(
  COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/fuzz" -B "${WORK_DIR}/build" ${_generator} -DCMAKE_BUILD_TYPE=RelWithDebInfo
          -DCMAKE_CXX_COMPILER=${CLANGXX} "-DTorch_DIR=${Torch_DIR}" "-DCMAKE_PREFIX_PATH=${_prefix_arg}"
          "-DTORCHDBG_INCLUDE_DIR=${SOURCE_DIR}/include"
  RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the fuzz targets failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the fuzz targets failed: ${rc}")
endif()
foreach(_target paths hooks)
  file(MAKE_DIRECTORY "${WORK_DIR}/corpus_${_target}")
  file(GLOB _seeds "${SOURCE_DIR}/tests/fuzz/corpus_${_target}/*")
  file(COPY ${_seeds} DESTINATION "${WORK_DIR}/corpus_${_target}")
  # ASan's leak check is off: LibTorch keeps process-lifetime allocations it never frees.
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env ASAN_OPTIONS=detect_leaks=0
            "${WORK_DIR}/build/fuzz_${_target}" -max_total_time=${SECONDS} -max_len=96 -timeout=10
            -artifact_prefix=${WORK_DIR}/ "${WORK_DIR}/corpus_${_target}"
    RESULT_VARIABLE rc ERROR_VARIABLE err)
  string(REGEX MATCH "Done [0-9]+ runs[^\n]*" _done "${err}")
  message("fuzz_${_target}: ${_done}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fuzz_${_target} found a failing input (see ${WORK_DIR}/crash-*):\n${err}")
  endif()
endforeach()
