# Included by the top-level CMakeLists.txt: asks cargo which native libraries the Rust static
# library needs, so that devshare::devshare_static, devshare-static.pc and devshare.pc's
# Libs.private link exactly what this toolchain and these dependencies need:
#
#   cargo rustc [--release] --lib --crate-type staticlib -- --print native-static-libs
#
# That compiles the crate once more as a staticlib-only unit (the dependencies are shared with the
# main build, so the first configure compiles them; later builds reuse them). The answer is cached
# in the build tree and asked again when Cargo.toml, Cargo.lock, build.rs, the profile or
# `rustc -vV` change.
#
# In:  CARGO_EXECUTABLE, DEVSHARE_CARGO_TARGET_DIR, DEVSHARE_CARGO_PROFILE_ARGS, PROJECT_SOURCE_DIR
# Out: DEVSHARE_NATIVE_STATIC_LIBS  (CMake list: dl;gcc_s;...; non -l flags kept as they are)
#      DEVSHARE_NATIVE_STATIC_FLAGS (the linker flags as rustc printed them: -ldl -lgcc_s ...)

set(_nsl_cache "${CMAKE_BINARY_DIR}/devshare_native_static_libs.txt")
set(_nsl_key_file "${CMAKE_BINARY_DIR}/devshare_native_static_libs.key")

execute_process(COMMAND "${CARGO_EXECUTABLE}" -vV OUTPUT_VARIABLE _nsl_cargo_vv ERROR_QUIET)
get_filename_component(_nsl_cargo_dir "${CARGO_EXECUTABLE}" DIRECTORY)
find_program(DEVSHARE_RUSTC_EXECUTABLE rustc HINTS "${_nsl_cargo_dir}")
execute_process(COMMAND "${DEVSHARE_RUSTC_EXECUTABLE}" -vV OUTPUT_VARIABLE _nsl_rustc_vv ERROR_QUIET
  WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")

function(_devshare_nsl_key out)
  set(key "${_nsl_cargo_vv}${_nsl_rustc_vv}profile=${DEVSHARE_CARGO_PROFILE_ARGS}\n")
  foreach(f IN ITEMS Cargo.toml Cargo.lock build.rs)
    if(EXISTS "${PROJECT_SOURCE_DIR}/${f}")
      file(SHA256 "${PROJECT_SOURCE_DIR}/${f}" h)
      string(APPEND key "${f}=${h}\n")
    endif()
  endforeach()
  set(${out} "${key}" PARENT_SCOPE)
endfunction()

function(_devshare_nsl_ask out)
  execute_process(
    COMMAND "${CMAKE_COMMAND}" -E env "CARGO_TARGET_DIR=${DEVSHARE_CARGO_TARGET_DIR}"
            "${CARGO_EXECUTABLE}" rustc ${DEVSHARE_CARGO_PROFILE_ARGS} --lib --crate-type staticlib
            --manifest-path "${PROJECT_SOURCE_DIR}/Cargo.toml" -- --print native-static-libs
    WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
    RESULT_VARIABLE rc
    OUTPUT_VARIABLE stdout
    ERROR_VARIABLE stderr)
  if(NOT rc EQUAL 0)
    if(EXISTS "${_nsl_cache}")
      # E.g. sources that do not compile right now: keep the last answer, ask again next time.
      file(READ "${_nsl_cache}" flags)
      string(STRIP "${flags}" flags)
      message(WARNING "devshare: `cargo rustc --print native-static-libs` failed; using the "
                      "previous answer (${flags}):\n${stderr}")
      set(${out} "${flags}" PARENT_SCOPE)
      set(_nsl_failed TRUE PARENT_SCOPE)
      return()
    endif()
    message(FATAL_ERROR "devshare: `cargo rustc --print native-static-libs` failed:\n${stderr}")
  endif()
  if("${stdout}${stderr}" MATCHES "native-static-libs: ([^\r\n]*)")
    string(STRIP "${CMAKE_MATCH_1}" flags)
    set(${out} "${flags}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

_devshare_nsl_key(_nsl_key_before)
set(_nsl_old_key "")
if(EXISTS "${_nsl_key_file}")
  file(READ "${_nsl_key_file}" _nsl_old_key)
endif()
if(EXISTS "${_nsl_cache}" AND _nsl_old_key STREQUAL _nsl_key_before)
  file(READ "${_nsl_cache}" DEVSHARE_NATIVE_STATIC_FLAGS)
  string(STRIP "${DEVSHARE_NATIVE_STATIC_FLAGS}" DEVSHARE_NATIVE_STATIC_FLAGS)
else()
  message(STATUS "devshare: asking cargo which native libraries the static library needs "
                 "(cargo rustc --print native-static-libs; the first time this compiles the crate)")
  set(_nsl_failed FALSE)
  _devshare_nsl_ask(DEVSHARE_NATIVE_STATIC_FLAGS)
  if(NOT DEVSHARE_NATIVE_STATIC_FLAGS)
    # rustc prints the list only when it links the staticlib; cargo found that unit fresh.
    execute_process(
      COMMAND "${CMAKE_COMMAND}" -E env "CARGO_TARGET_DIR=${DEVSHARE_CARGO_TARGET_DIR}"
              "${CARGO_EXECUTABLE}" clean ${DEVSHARE_CARGO_PROFILE_ARGS} -p devshare
              --manifest-path "${PROJECT_SOURCE_DIR}/Cargo.toml"
      WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}" OUTPUT_QUIET ERROR_QUIET)
    _devshare_nsl_ask(DEVSHARE_NATIVE_STATIC_FLAGS)
  endif()
  if(NOT DEVSHARE_NATIVE_STATIC_FLAGS)
    message(FATAL_ERROR "devshare: cargo rustc did not print the native-static-libs line")
  endif()
  if(NOT _nsl_failed)
    file(WRITE "${_nsl_cache}" "${DEVSHARE_NATIVE_STATIC_FLAGS}\n")
    # cargo may have updated Cargo.lock: the key is taken after the question.
    _devshare_nsl_key(_nsl_key_after)
    file(WRITE "${_nsl_key_file}" "${_nsl_key_after}")
  endif()
endif()
message(STATUS "devshare: the static library needs ${DEVSHARE_NATIVE_STATIC_FLAGS}")

separate_arguments(_nsl_flags UNIX_COMMAND "${DEVSHARE_NATIVE_STATIC_FLAGS}")
set(DEVSHARE_NATIVE_STATIC_LIBS "")
foreach(_nsl_flag IN LISTS _nsl_flags)
  if(_nsl_flag MATCHES "^-l(.+)$")
    list(APPEND DEVSHARE_NATIVE_STATIC_LIBS "${CMAKE_MATCH_1}")
  else()
    list(APPEND DEVSHARE_NATIVE_STATIC_LIBS "${_nsl_flag}")
  endif()
endforeach()
