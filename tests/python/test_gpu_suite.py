"""The real-GPU suite (tests/gpu) stays runnable without a GPU: its C helper gpu_tool compiles
warning-free against this checkout's header, its dry run passes (every struct's layout, the
synthetic 'c' and 'e' tuples and the refusals, and the graph-replay consumer over a host pool with
CPU stand-in graphs, including that a graph bound to the wrong address is caught), and its C-only
cases pass on the CUDA stand-in (C producer -> C consumer, C VMM producer -> C consumer with inline
and text-carried segment tables, C pool producer -> C consumer over a channel for cuMemAlloc and
VMM exports, the import benchmark; the ptrace case skips without Yama ptrace_scope 1). The run's
time bounds fit a 10-minute slot.

The bundle is assembled here the way scripts/gpu_bundle.sh does it, from the library under test.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import abi_check
import devshare
from conftest import ROOT, run

RUN_SH = ROOT / "tests" / "gpu" / "run.sh"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> pathlib.Path:
    cc = abi_check.find_cc()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang; or $CC) to build gpu_tool")
    out = tmp_path_factory.mktemp("gpu-bundle")
    shutil.copy(devshare.library_path, out / "libdevshare.so")
    shutil.copy(devshare.library_path, out / f"libdevshare.so.{devshare._abi.EXPECTED_MAJOR}")
    res = subprocess.run([cc, "-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "include"),
                          "-o", str(out / "gpu_tool"), str(ROOT / "tests" / "gpu" / "gpu_tool.c"),
                          f"-L{out}", "-ldevshare", "-ldl", "-Wl,-rpath,$ORIGIN"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"gpu_tool does not build warning-free:\n{res.stderr}"
    return out


def suite(bundle: pathlib.Path, *args, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHON=sys.executable, **env)
    return run(["bash", str(RUN_SH), str(bundle), *args], env=full, timeout=300)


def verdicts(out: str) -> dict:
    return {m.group(2): m.group(1) for m in re.finditer(r"^(PASS|FAIL|SKIP) (\S+?)[:\s]", out, re.M)}


def test_gpu_suite_dry_run_passes(bundle):
    res = suite(bundle, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    v = verdicts(res.stdout)
    assert v.get("layout") == "PASS" and "every field of the 11 mirrored structs" in res.stdout
    for case in ("dry_e_fd", "dry_e_fd_long_table", "dry_e_fabric", "dry_e_v1", "dry_e_v4", "dry_e_pid0",
                 "dry_e3_fd", "dry_e3_fd_type0", "dry_e3_fabric", "dry_e3_long_table", "dry_e3_bridged_to_v2",
                 "dry_e3_type9", "dry_e3_type_vs_length", "dry_graph_replay_host_16k", "dry_graph_replay_host_256k",
                 "dry_graph_replay_host_stale_caught"):
        assert v.get(case) == "PASS", res.stdout
    assert len(re.findall(r"dry_graph_replay_host_\d+k\| host .* clone/graph +[\d.]+x .* 0 recaptures;", res.stdout)) == 2, \
        res.stdout
    assert re.search(r"^SUMMARY: \d+ passed, 0 failed, 0 skipped$", res.stdout, re.M), res.stdout


def test_gpu_suite_c_only_cases_pass_on_the_cuda_standin(bundle, tmp_path):
    standin = pathlib.Path(devshare.library_path).resolve().parent / "standin" / "cuda" / "libcuda.so.1"
    assert standin.exists(), f"the CUDA stand-in is built next to the library by build.rs: {standin}"
    log = tmp_path / "standin.log"
    res = suite(bundle, "--only", "h,k,l,m,e1,n", DEVSHARE_CUDA_LIBRARY=str(standin),
                LD_LIBRARY_PATH=str(standin.parent), DEVSHARE_STANDIN_LOG=str(log))
    v = verdicts(res.stdout)
    for case in ("h_c_to_c", "l_vmm_c_to_c", "m_pool_c_to_c", "e1_bench_import"):
        assert v.get(case) == "PASS", res.stdout + res.stderr
    assert v.get("k_ptrace_sibling") in ("PASS", "SKIP"), res.stdout
    assert v.get("n_graph_replay") == "SKIP", res.stdout  # torch has no CUDA here
    assert "kind=fd table=external" in res.stdout  # the 40-segment table travelled in the text
    # The pool case: both exports, 40 items each, consumer and producer agree.
    for kind in ("cuda", "vmm"):
        assert re.search(rf"m_pool_c_to_c\| {kind}: consumer OK items=40 pool=\d+ base=0x", res.stdout), res.stdout
        assert re.search(rf"m_pool_c_to_c\| {kind}: producer DONE items=40 uses=", res.stdout), res.stdout
    # The closing report: one table row per case, the environment line, then the summary.
    for case in ("preflight", "h_c_to_c", "k_ptrace_sibling", "l_vmm_c_to_c", "m_pool_c_to_c", "e1_bench_import",
                 "n_graph_replay"):
        assert re.search(rf"^\| {case} \| (PASS|FAIL|SKIP) \| ", res.stdout, re.M), res.stdout
    tail = res.stdout.strip().splitlines()[-2:]
    assert tail[0].startswith("ENV: GPU ") and " torch " in tail[0] and " driver " in tail[0], tail
    assert tail[1].startswith("SUMMARY: "), tail
    assert not (log.exists() and log.read_text()), f"CUDA rules broken:\n{log.read_text()}"


def test_gpu_suite_lists_the_graph_case_and_fits_ten_minutes(bundle):
    res = suite(bundle, "--list")
    assert res.returncode == 0, res.stdout + res.stderr
    names = [ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()]
    assert "n_graph_replay" in names and "m_pool_c_to_c" in names, res.stdout
    # run.sh's hard stop, and the budget after which the runner starts no case, leave room in a
    # 10-minute slot (the preflight, and killing what a stopped run left, come on top).
    limit = int(re.search(r"^limit=(\d+)$", RUN_SH.read_text(), re.M).group(1))
    budget = float(re.search(r"^RUN_BUDGET_S = ([\d.]+)$", (RUN_SH.parent / "gpu_cases.py").read_text(),
                             re.M).group(1))
    assert budget < limit <= 480, (budget, limit)


def test_gpu_tool_pool_commands_refuse_bad_arguments(bundle):
    tool = str(bundle / "gpu_tool")
    for argv in (["produce-pool", "tpu", "@x", "4", "16", "8", "1000"],
                 ["produce-pool", "host", "@x", "0", "16", "8", "1000"],
                 ["produce-pool", "host", "@x", "4", "0", "8", "1000"],
                 ["consume-pool", "@x", "0", "1000"],
                 ["consume-pool", "@x", "4", "1000", "cuda"]):
        r = subprocess.run([tool, *argv], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and r.stdout.startswith("FAIL usage:"), (argv, r.stdout, r.stderr)
    r = subprocess.run([tool, "produce-pool", "host"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "produce-pool" in r.stderr
