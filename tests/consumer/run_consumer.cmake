# Builds and runs tests/consumer against torchdbg, either installed (find_package, distributed)
# or as a subdirectory. Invoked by ctest with -DMODE=... -DSOURCE_DIR=... -DBUILD_DIR=... -DWORK_DIR=...
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(_prefix_path "${PREFIX_PATH}")
set(_extra "")
# The installed package is used from a Release build, the subdirectory from a Debug one
# (no NDEBUG: some LibTorch inline code differs there).
set(_build_type Release)
if(MODE STREQUAL "find_package" OR MODE STREQUAL "distributed")
  execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix"
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install failed: ${rc}")
  endif()
  list(PREPEND _prefix_path "${WORK_DIR}/prefix")
else()
  set(_extra "-DTORCHDBG_SOURCE_DIR=${SOURCE_DIR}")
  set(_build_type Debug)
endif()
string(REPLACE ";" "\\;" _prefix_arg "${_prefix_path}")
include(${CMAKE_CURRENT_LIST_DIR}/../nested_generator.cmake)
execute_process(
  COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/build" ${_generator}
          -DCMAKE_BUILD_TYPE=${_build_type} -DCMAKE_CXX_COMPILER=${CXX}
          "-DCMAKE_PREFIX_PATH=${_prefix_arg}" "-DTorch_DIR=${Torch_DIR}"
          -DTORCHDBG_CONSUMER_MODE=${MODE} ${_extra}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "build failed: ${rc}")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" "${WORK_DIR}/store" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer failed: ${rc}")
endif()
if(MODE STREQUAL "find_package")
  execute_process(COMMAND "${WORK_DIR}/build/consumer_compiled" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer_compiled failed: ${rc}")
  endif()
endif()
