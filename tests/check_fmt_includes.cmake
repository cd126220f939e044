# Each file that uses an fmt function outside fmt/format.h includes that function's header.
# LibTorch 2.x zips put their own fmt (11 or later) first on the include path, and there
# fmt::join lives only in fmt/ranges.h; Debian's fmt 9 and 10 still declare it in format.h,
# so a missing include compiles here and fails for those users.
#   cmake -DSOURCE_DIR=<repo> -P check_fmt_includes.cmake
# Each rule: a regular expression for the use, "=>", the header.
set(_rules "fmt::join\\(=>fmt/ranges.h" "fmt::streamed\\(=>fmt/ostream.h" "fmt::(localtime|gmtime)\\(=>fmt/chrono.h")
file(GLOB_RECURSE _files "${SOURCE_DIR}/include/*.hpp" "${SOURCE_DIR}/tests/*.cpp" "${SOURCE_DIR}/tests/*.hpp"
     "${SOURCE_DIR}/bench/*.cpp" "${SOURCE_DIR}/bench/*.hpp" "${SOURCE_DIR}/examples/*.cpp")
set(_bad "")
foreach(_f ${_files})
  file(READ "${_f}" _text)
  foreach(_rule ${_rules})
    string(REPLACE "=>" ";" _pair "${_rule}")
    list(GET _pair 0 _use)
    list(GET _pair 1 _header)
    if(_text MATCHES "${_use}" AND NOT _text MATCHES "#include <${_header}>")
      file(RELATIVE_PATH _rel "${SOURCE_DIR}" "${_f}")
      list(APPEND _bad "${_rel}: uses ${_use} without #include <${_header}>")
    endif()
  endforeach()
endforeach()
if(_bad)
  string(REPLACE ";" "\n" _msg "${_bad}")
  message(FATAL_ERROR "${_msg}")
endif()
list(LENGTH _files _n)
message(STATUS "fmt includes: ${_n} files checked")
