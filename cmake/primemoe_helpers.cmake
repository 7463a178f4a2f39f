# Helpers of primemoe's CMakeLists.txt: architecture check and the third-party lookups (third_party/locate.py, the
# same code setup.py uses, so that both builds find the same CUTLASS and NVSHMEM).

# out = ON when 90a (also as 90a-real / 90a-virtual) is in the architecture list, else OFF.
function(primemoe_has_sm90a out archs)
  set(found OFF)
  foreach(arch IN LISTS archs)
    if(arch MATCHES "^90a(-real|-virtual)?$")
      set(found ON)
    endif()
  endforeach()
  set(${out} ${found} PARENT_SCOPE)
endfunction()

# Runs third_party/locate.py's `expr` with a Python interpreter and stores its one line of output in `out`; a
# failure stops the configure with locate.py's message and `hint`. The interpreter: -DPython3_EXECUTABLE=..., else
# the active virtual environment's, else this checkout's .venv (scripts/setup.sh), else the first python3 found.
function(primemoe_locate out expr hint)
  if(NOT Python3_EXECUTABLE AND NOT DEFINED ENV{VIRTUAL_ENV} AND EXISTS ${PROJECT_SOURCE_DIR}/.venv/bin/python)
    set(Python3_EXECUTABLE ${PROJECT_SOURCE_DIR}/.venv/bin/python CACHE FILEPATH "Python for third_party/locate.py")
  endif()
  if(NOT Python3_EXECUTABLE)
    find_package(Python3 COMPONENTS Interpreter REQUIRED)
  endif()
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import sys; sys.path.insert(0, 'third_party'); import locate; print(${expr})"
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    OUTPUT_VARIABLE value OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_VARIABLE error ERROR_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${error}\n${hint}")
  endif()
  set(${out} "${value}" PARENT_SCOPE)
endfunction()

# CUTLASS/CuTe 4.2 headers: -DPRIMEMOE_CUTLASS_INCLUDE=..., else the nvidia-cutlass wheel.
function(primemoe_find_cutlass var)
  if(NOT ${var})
    primemoe_locate(dir "locate.cutlass_include()"
      "Install nvidia-cutlass==4.2.0.0, pass -DPRIMEMOE_CUTLASS_INCLUDE=<dir with cute/>, or -DPRIMEMOE_BUILD_GEMM=OFF.")
    set(${var} "${dir}" CACHE PATH "CUTLASS/CuTe include directory (holds cute/ and cutlass/)" FORCE)
  endif()
  if(NOT EXISTS "${${var}}/cute/tensor.hpp")
    message(FATAL_ERROR "primemoe: ${var}=${${var}} holds no cute/tensor.hpp")
  endif()
  message(STATUS "primemoe: CUTLASS headers ${${var}}")
endfunction()

# NVSHMEM root (include/, lib/): -DPRIMEMOE_NVSHMEM_ROOT=..., else the pip package (nvidia/nvshmem).
function(primemoe_find_nvshmem_root var)
  if(NOT ${var})
    primemoe_locate(dir "locate.nvshmem_root()"
      "Install nvidia-nvshmem-cu13==3.4.5, pass -DPRIMEMOE_NVSHMEM_ROOT=<dir with include/ lib/>, or -DPRIMEMOE_BUILD_EP=OFF.")
    set(${var} "${dir}" CACHE PATH "NVSHMEM root (include/nvshmem.h, lib/libnvshmem_device.a)" FORCE)
  endif()
  message(STATUS "primemoe: NVSHMEM ${${var}}")
endfunction()

# The C API version from the header's PRIMEMOE_CAPI_VERSION_{MAJOR,MINOR,PATCH}: out = "M.m.p", out_major = M.
function(primemoe_capi_version out out_major header)
  file(STRINGS ${header} lines REGEX "^#define PRIMEMOE_CAPI_VERSION_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(part MAJOR MINOR PATCH)
    if(NOT lines MATCHES "PRIMEMOE_CAPI_VERSION_${part} +([0-9]+)")
      message(FATAL_ERROR "primemoe: no PRIMEMOE_CAPI_VERSION_${part} in ${header}")
    endif()
    set(${part} ${CMAKE_MATCH_1})
  endforeach()
  set(${out} "${MAJOR}.${MINOR}.${PATCH}" PARENT_SCOPE)
  set(${out_major} "${MAJOR}" PARENT_SCOPE)
endfunction()
