cmake_minimum_required(VERSION 3.16)
# Runs examples/distributed_training with 2 ranks at once (execute_process starts every
# COMMAND concurrently) over a FileStore, as the README shows with a TCPStore.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(
  COMMAND sh -c "\"${EXE}\" --rank 0 --world-size 2 --store file://${WORK}/store > \"${WORK}/rank0.txt\" 2>&1"
  COMMAND sh -c "\"${EXE}\" --rank 1 --world-size 2 --store file://${WORK}/store > \"${WORK}/rank1.txt\" 2>&1"
  RESULTS_VARIABLE rcs TIMEOUT 240)
file(READ "${WORK}/rank0.txt" r0)
file(READ "${WORK}/rank1.txt" r1)
message("${r0}${r1}")
foreach(rc ${rcs})
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "a rank failed (${rcs})")
  endif()
endforeach()
