# NVSHMEM as two imported targets, from the pip package's layout (nvidia/nvshmem/{include,lib}), as setup.py links it:
#   primemoe::nvshmem_device  lib/libnvshmem_device.a, for the device link of -rdc code (and the host link)
#   primemoe::nvshmem_host    lib/libnvshmem_host.so.3 by its versioned name (pip ships no unversioned libnvshmem_host.so)
# Host and device library must come from the same NVSHMEM release (3.4.5 with torch 2.11 / 2.14).
# Input: PRIMEMOE_NVSHMEM_ROOT. Used by CMakeLists.txt and by the installed primemoe-config.cmake.
if(NOT TARGET primemoe::nvshmem_host)
  foreach(file include/nvshmem.h lib/libnvshmem_device.a lib/libnvshmem_host.so.3)
    if(NOT EXISTS "${PRIMEMOE_NVSHMEM_ROOT}/${file}")
      message(FATAL_ERROR "primemoe: NVSHMEM root '${PRIMEMOE_NVSHMEM_ROOT}' has no ${file} "
                          "(set PRIMEMOE_NVSHMEM_ROOT to the pip package's nvidia/nvshmem)")
    endif()
  endforeach()
  add_library(primemoe::nvshmem_host SHARED IMPORTED)
  set_target_properties(primemoe::nvshmem_host PROPERTIES
    IMPORTED_LOCATION "${PRIMEMOE_NVSHMEM_ROOT}/lib/libnvshmem_host.so.3"
    IMPORTED_SONAME "libnvshmem_host.so.3"
    INTERFACE_INCLUDE_DIRECTORIES "${PRIMEMOE_NVSHMEM_ROOT}/include")
  add_library(primemoe::nvshmem_device STATIC IMPORTED)
  set_target_properties(primemoe::nvshmem_device PROPERTIES
    IMPORTED_LOCATION "${PRIMEMOE_NVSHMEM_ROOT}/lib/libnvshmem_device.a"
    INTERFACE_INCLUDE_DIRECTORIES "${PRIMEMOE_NVSHMEM_ROOT}/include")
endif()
