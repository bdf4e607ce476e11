"""Launcher detection from environment variables alone (no processes needed)."""

from __future__ import annotations

import pytest

from mesh3d.launcher import LaunchInfo, detect_launcher, first_slurm_host, slurm_master_port


def test_plain_process_is_a_world_of_one():
    assert detect_launcher({}) == LaunchInfo("none", 0, 1, 0, None, None)


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "abc"}
    assert detect_launcher(env) == LaunchInfo("torchrun", 5, 8, 1, "node7", 29500)


def test_env_launcher_without_torchelastic():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    info = detect_launcher(env)
    assert info.launcher == "env" and info.local_rank == 0


def test_torchrun_wins_over_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "3"}
    assert detect_launcher(env).launcher == "torchrun"


def test_slurm_variables_and_first_node():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2",
           "SLURM_JOB_NODELIST": "gpu[007-010,012],login1", "SLURM_JOB_ID": "123456"}
    info = detect_launcher(env)
    assert info == LaunchInfo("slurm", 6, 16, 2, "gpu007", slurm_master_port("123456"))


def test_slurm_master_addr_and_port_overrides():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "4000"}
    info = detect_launcher(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 4000)


def test_slurm_port_is_the_same_for_every_rank_of_a_job():
    assert slurm_master_port("99") == slurm_master_port("99")
    assert slurm_master_port("99") != slurm_master_port("100")
    assert 1024 < slurm_master_port("4294967295") < 65536
    # below the kernel's ephemeral range (32768-60999), from which outgoing connections take their ports
    assert max(slurm_master_port(str(job)) for job in range(40000)) == 32767


@pytest.mark.parametrize(
    "nodelist, first",
    [("node1", "node1"), ("node[001-004]", "node001"), ("a[3,5-7]", "a3"), ("rack[1-2]-n[03-04]", "rack1-n03"),
     ("x[10-11],y[1-2]", "x10"), ("login-1,gpu[1-2]", "login-1")],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    "env, fragment",
    [({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
     ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "rank 2 is outside [0, 2)"),
     ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR/MASTER_PORT"),
     ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "SLURM_JOB_NODELIST"),
     ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "world size 0")],
)
def test_misconfigured_launchers_are_explained(env, fragment):
    with pytest.raises(ValueError) as info:
        detect_launcher(env)
    assert fragment in str(info.value)
