"""Workers on one host get disjoint cores: parsing, dealing, and a real
worker process pinned where it was told."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_fixtures import tiny
from worker_fixtures import refused_start, start_worker

from tandem.cluster import LocalCluster
from worker.cpu_cores import format_cores, parse_cores, placement_flags, split_cores


def test_core_lists_round_trip():
    assert parse_cores("0-2,5") == [0, 1, 2, 5]
    assert parse_cores(" 3 , 1-2") == [1, 2, 3]
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_cores(parse_cores("4,0-1")) == "0-1,4"
    for bad in ("", "a", "3-1", "-1", "1-", "0,,1"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_split_deals_disjoint_even_shares():
    assert split_cores(2, [0, 1]) == ["0", "1"]
    assert split_cores(3, list(range(8))) == ["0-2", "3-5", "6-7"]
    assert split_cores(2, [0, 2, 4, 6, 7]) == ["0,2,4", "6-7"]
    assert split_cores(3, [0, 1]) is None  # fewer cores than workers: they share
    shares = [parse_cores(s) for s in split_cores(4, list(range(16)))]
    assert sorted(c for s in shares for c in s) == list(range(16))


def test_placement_gives_each_worker_its_share_and_lends_them_all():
    assert placement_flags(["0-1", "2-3"]) == [
        ["--cpu-cores", "0-1", "--borrow-cores", "0-1,2-3"],
        ["--cpu-cores", "2-3", "--borrow-cores", "0-1,2-3"]]
    assert placement_flags(["0", "1"], lend=False) == [["--cpu-cores", "0"], ["--cpu-cores", "1"]]
    assert placement_flags(["0-3"]) == [["--cpu-cores", "0-3"]]  # nobody to borrow from


def _allowed_cores(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cores(line.split(":", 1)[1])
    raise AssertionError("no Cpus_allowed_list")


def test_a_worker_computes_on_the_cores_it_was_given():
    core = sorted(os.sched_getaffinity(0))[-1]
    model_dir = tiny("llama-gqa")[0]
    with LocalCluster() as cluster:
        w = start_worker(cluster, "both", model_dir, 32, "--cpu-cores", str(core))
        assert _allowed_cores(w.proc.popen.pid) == [core]
        assert f"computing on cores {core}" in w.proc.output()


def test_a_core_the_process_may_not_use_is_refused():
    from worker.cpu_cores import pin_to_cores

    with pytest.raises(ValueError, match="not available"):
        pin_to_cores(str(max(os.sched_getaffinity(0)) + 1))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_worker_that_borrows_may_run_on_the_cores_it_borrows(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[-2:]
    model_dir = tiny("llama-gqa")[0]
    with LocalCluster() as cluster:
        w = start_worker(cluster, "both", model_dir, 32, "--cpu-cores", str(cores[0]),
                         "--borrow-cores", format_cores(cores), "--core-lock-dir", str(tmp_path))
        assert _allowed_cores(w.proc.popen.pid) == cores
        assert f"borrowing cores {cores[1]} while their owners idle" in w.proc.output()
        assert {p.name for p in tmp_path.iterdir()} == {f"{c}.{kind}" for c in cores
                                                        for kind in ("run", "claim", "want")}


def test_borrowing_without_cores_of_ones_own_is_refused():
    assert "--borrow-cores needs --cpu-cores" in refused_start("--borrow-cores", "0-1")