"""The real-GPU suite (tests/gpu) stays runnable without a GPU: its C helper gpu_tool compiles
warning-free against this checkout's header, its dry run passes (every struct's layout, the
synthetic 'c' and 'e' tuples and the refusals, and the graph-replay consumer over a host pool with
CPU stand-in graphs, including that a graph bound to the wrong address is caught, and the
registered state dict case over CPU tensors), and its C-only
cases pass on the CUDA stand-in (C producer -> C consumer, C VMM producer -> C consumer with inline
and text-carried segment tables, C pool producer -> C consumer over a channel for cuMemAlloc and
VMM exports, the import benchmark; the ptrace case skips without Yama ptrace_scope 1). The run's
time bounds fit a 10-minute slot. The one-command session script (tests/gpu/session.sh) skips
what the machine and its budget do not allow, saying why, and keeps each part's output.

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

# Names of the suite's cases and dry-run checks (tests/gpu/gpu_cases.py) that these tests look for.
C_TO_C = "c_consumer_reads_and_writes_a_c_export_window"
PTRACE_SIBLING = "sibling_consumer_is_refused_under_ptrace_scope_1_unless_allowed"
VMM_C_TO_C = "c_consumer_imports_c_vmm_exports_with_inline_and_text_tables"
POOL_C_TO_C = "c_pool_items_reach_a_c_consumer_at_fixed_slot_addresses"
BENCH_IMPORT = "measure_cold_against_cached_cuda_import"
GRAPHS = "cuda_pool_slots_replay_captured_graphs_without_recapture"
HOST_GRAPHS = "host_pool_slots_replay_captured_graphs_without_recapture"
HOST_REGISTERED = "host_registered_state_dict_syncs_ten_times_and_thousands_of_unread_leases_fit"


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
    res = subprocess.run([cc, "-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-o", str(out / "sync_cost"),
                          str(ROOT / "tests" / "gpu" / "sync_cost.c"), "-ldl"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"sync_cost does not build warning-free:\n{res.stderr}"
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
    assert v.get("gpu_tool_layout_matches_the_header_and_the_ctypes_mirrors") == "PASS" \
        and "every field of the 11 mirrored structs" in res.stdout
    for case in ("e_tuple_version_2_of_1_fd_round_trips_as_segments",
                 "e_tuple_version_2_of_40_fds_carries_its_table_in_the_text",
                 "e_tuple_version_2_of_fabric_handles_round_trips_as_segments",
                 "e_tuple_version_1_is_refused_naming_the_version",
                 "e_tuple_version_4_is_refused_naming_the_version",
                 "e_tuple_with_pid_0_is_refused",
                 "e_tuple_version_3_of_fds_round_trips_as_segments",
                 "e_tuple_version_3_of_handle_type_0_reads_as_fds",
                 "e_tuple_version_3_of_fabric_handles_round_trips_as_segments",
                 "e_tuple_version_3_of_40_fds_carries_its_table_in_the_text",
                 "e_tuple_version_3_converted_to_version_2_reads_the_same",
                 "e_tuple_version_3_of_handle_type_9_is_refused_naming_the_type",
                 "e_tuple_version_3_whose_handle_type_contradicts_its_length_is_refused",
                 f"{HOST_GRAPHS}_16k", f"{HOST_GRAPHS}_256k",
                 "a_graph_replaying_a_copy_of_its_slot_is_caught",
                 HOST_REGISTERED):
        assert v.get(case) == "PASS", res.stdout
    assert len(re.findall(rf"{HOST_GRAPHS}_\d+k\| host .* clone/graph +[\d.]+x .* 0 recaptures;", res.stdout)) == 2, \
        res.stdout
    assert re.search(r"^SUMMARY: \d+ passed, 0 failed, 0 skipped$", res.stdout, re.M), res.stdout


def test_gpu_suite_c_only_cases_pass_on_the_cuda_standin(bundle, tmp_path):
    standin = pathlib.Path(devshare.library_path).resolve().parent / "standin" / "cuda" / "libcuda.so.1"
    assert standin.exists(), f"the CUDA stand-in is built next to the library by build.rs: {standin}"
    log = tmp_path / "standin.log"
    only = ",".join((C_TO_C, PTRACE_SIBLING, VMM_C_TO_C, POOL_C_TO_C, BENCH_IMPORT, GRAPHS))
    res = suite(bundle, "--only", only, DEVSHARE_CUDA_LIBRARY=str(standin),
                LD_LIBRARY_PATH=str(standin.parent), DEVSHARE_STANDIN_LOG=str(log))
    v = verdicts(res.stdout)
    for case in (C_TO_C, VMM_C_TO_C, POOL_C_TO_C, BENCH_IMPORT):
        assert v.get(case) == "PASS", res.stdout + res.stderr
    assert v.get(PTRACE_SIBLING) in ("PASS", "SKIP"), res.stdout
    assert v.get(GRAPHS) == "SKIP", res.stdout  # torch has no CUDA here
    assert "kind=fd table=external" in res.stdout  # the 40-segment table travelled in the text
    # The pool case: both exports, 40 items each, consumer and producer agree.
    for kind in ("cuda", "vmm"):
        assert re.search(rf"{POOL_C_TO_C}\| {kind}: consumer OK items=40 pool=\d+ base=0x", res.stdout), res.stdout
        assert re.search(rf"{POOL_C_TO_C}\| {kind}: producer DONE items=40 uses=", res.stdout), res.stdout
    # The closing report: one table row per case, the environment line, then the summary.
    for case in ("preflight", C_TO_C, PTRACE_SIBLING, VMM_C_TO_C, POOL_C_TO_C, BENCH_IMPORT, GRAPHS):
        assert re.search(rf"^\| {case} \| (PASS|FAIL|SKIP) \| ", res.stdout, re.M), res.stdout
    tail = res.stdout.strip().splitlines()[-2:]
    assert tail[0].startswith("ENV: GPU ") and " torch " in tail[0] and " driver " in tail[0], tail
    assert tail[1].startswith("SUMMARY: "), tail
    assert not (log.exists() and log.read_text()), f"CUDA rules broken:\n{log.read_text()}"


def test_gpu_suite_lists_the_graph_case_and_fits_ten_minutes(bundle):
    res = suite(bundle, "--list")
    assert res.returncode == 0, res.stdout + res.stderr
    names = [ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()]
    assert GRAPHS in names and POOL_C_TO_C in names, res.stdout
    # run.sh's hard stop, and the budget after which the runner starts no case, leave room in a
    # 10-minute slot (the preflight, and killing what a stopped run left, come on top).
    limit = int(re.search(r"^limit=\$\{DEVSHARE_GPU_LIMIT_S:-(\d+)\}$", RUN_SH.read_text(), re.M).group(1))
    budget = float(re.search(r'^RUN_BUDGET_S = float\(os.environ.get\("DEVSHARE_GPU_RUN_BUDGET_S", "([\d.]+)"\)\)$',
                             (RUN_SH.parent / "gpu_cases.py").read_text(), re.M).group(1))
    assert budget < limit <= 480, (budget, limit)
    # run.sh gives the cases its own stop less 30 s (a caller's DEVSHARE_GPU_LIMIT_S included).
    assert "export DEVSHARE_GPU_RUN_BUDGET_S=$((limit >= 60 ? limit - 30 : limit / 2))" in RUN_SH.read_text()
    assert budget == limit - 30, (budget, limit)


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


def test_sync_cost_measures_every_mechanism_on_the_cuda_standin_and_finds_each_correct(bundle, tmp_path):
    """tests/gpu/sync_cost (event against flag word) runs end to end on the CUDA stand-in: every
    mechanism's round trips and its checks against a busy producer stream, with no CUDA rule
    broken (the stand-in checks the stream memory operations' alignment, the DEVICEMAP
    registration of the host word, and that a waited-for word is written). The stand-in runs a
    stream's work at once, so its control ("none") cannot show stale data; on a GPU it must."""
    standin = pathlib.Path(devshare.library_path).resolve().parent / "standin" / "cuda" / "libcuda.so.1"
    log = tmp_path / "standin.log"
    env = dict(os.environ, DEVSHARE_CUDA_LIBRARY=str(standin), DEVSHARE_STANDIN_LOG=str(log))
    args = [str(bundle / "sync_cost"), "--rounds", "200", "--checks", "3", "--busy-mib", "1", "--busy-ms", "1"]
    res = subprocess.run([*args, "--no-control"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    for mech in ("event-stream", "event-host", "event-open", "flag-stream", "flag-device", "flag-poll", "host-sync"):
        assert re.search(rf"^ROUND {mech} n=200 roundtrip_us p50=[\d.]+ p90=[\d.]+ producer_us p50=[\d.]+ "
                         rf"consumer_call_us p50=[\d.]+ consumer_us p50=[\d.]+ stale=0$", res.stdout, re.M), res.stdout
        assert f"CHECK {mech} fresh=3/3" in res.stdout, res.stdout
    assert "CHECK none stale=0/3" in res.stdout, res.stdout
    assert re.search(r"^FASTEST (event-stream|flag-stream|flag-device) ", res.stdout, re.M), res.stdout
    assert not (log.exists() and log.read_text()), f"CUDA rules broken:\n{log.read_text()}"
    # With the control required (the default, as on a GPU), a control that read no stale data
    # makes the run inconclusive: no verdict, exit 1.
    res = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "INCONCLUSIVE the control read no stale data" in res.stdout and "FASTEST" not in res.stdout, res.stdout
    bad = subprocess.run([str(bundle / "sync_cost"), "--rounds", "0"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_the_session_script_runs_what_the_time_and_the_machine_allow_and_keeps_each_output(bundle, tmp_path):
    """tests/gpu/session.sh without a GPU: the suite runs and fails at its preflight, so the GPU
    benchmarks are skipped, saying why; with 65 s of budget user_pays is skipped too (it needs
    70). Each part's output and the summary are kept in --out; the exit status says a part
    failed."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the session would run the benchmarks")
    full = dict(os.environ, PYTHON=sys.executable)
    res = run(["bash", str(ROOT / "tests" / "gpu" / "session.sh"), str(bundle), "--budget", "65",
               "--out", str(tmp_path)], env=full, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^   suite: exit 1 after \d+ s$", summary, re.M), summary
    assert "== benchmarks skipped: no usable GPU (the suite's preflight did not pass)" in summary, summary
    assert re.search(r"^== user_pays skipped: \d+ s left$", summary, re.M), summary
    assert re.search(r"^== session: \d+ s of the 65 s budget", summary, re.M), summary
    assert "FAIL preflight" in (tmp_path / "suite.txt").read_text()
