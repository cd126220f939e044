# Included by the scripts that configure a nested CMake project (consumers, fuzz targets):
# sets _generator to the parent build's generator and make program (-DGENERATOR,
# -DMAKE_PROGRAM), so a machine with Ninja and no make builds them too.
set(_generator "")
if(GENERATOR)
  set(_generator -G "${GENERATOR}")
endif()
if(MAKE_PROGRAM)
  list(APPEND _generator "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()

# Removes the nested build directory `dir` when it was configured with another generator.
function(torchdbg_reset_if_other_generator dir)
  if(GENERATOR AND EXISTS "${dir}/CMakeCache.txt")
    file(STRINGS "${dir}/CMakeCache.txt" _cached REGEX "^CMAKE_GENERATOR:INTERNAL=")
    if(NOT _cached STREQUAL "CMAKE_GENERATOR:INTERNAL=${GENERATOR}")
      file(REMOVE_RECURSE "${dir}")
    endif()
  endif()
endfunction()
